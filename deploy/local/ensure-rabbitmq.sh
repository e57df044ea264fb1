#!/usr/bin/env bash
# Start RabbitMQ if nothing answers on ${RABBITMQ_HOST:-127.0.0.1}:${RABBITMQ_PORT:-5672}, then wait until it does.
set -euo pipefail
host=${RABBITMQ_HOST:-127.0.0.1}
port=${RABBITMQ_PORT:-5672}

answers() { timeout 2 bash -c "exec 3<>/dev/tcp/$host/$port" 2>/dev/null; }

if answers; then exit 0; fi
echo "RabbitMQ is not answering on $host:$port; starting it"
rabbitmq-server -detached
for _ in $(seq 1 120); do
  if answers && rabbitmqctl -q await_startup >/dev/null 2>&1; then
    echo "RabbitMQ is up"
    exit 0
  fi
  sleep 1
done
echo "RabbitMQ did not come up within 120 s on $host:$port" >&2
exit 1
