"""The `swift` backend (ms-swift 4.6.0 Megatron workers driven by our rollout batches).

ms-swift cannot live in the shared .venv (it caps transformers and peft below ours), so these
tests run their checks in the ms-swift environment made by deploy/local/install-swift.sh
(default `.venv-swift`, or `$HPCRL_SWIFT_PYTHON`) as a subprocess, and are skipped with the
reason when it does not exist. The checks themselves are real: ms-swift's own collate and
advantage code, a real tiny Qwen2, our torch backend as the reference. The GPU route needs
CUDA and Megatron-Core and is skipped with the reason where they are missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from hpcrl_learner.backends.swift import SwiftUnavailable, missing_requirements, swift_backend
from hpcrl_learner.config import LearnerSettings

ROOT = Path(__file__).resolve().parents[2]
SWIFT_PY = Path(os.environ.get("HPCRL_SWIFT_PYTHON", ROOT / ".venv-swift" / "bin" / "python"))
needs_swift_env = pytest.mark.skipif(
    not SWIFT_PY.exists(),
    reason=f"no ms-swift environment at {SWIFT_PY}: run deploy/local/install-swift.sh",
)

# Shared by every check: the suite's tiny model (built here: its builder, hpcrl_bootstrap, is not
# in .venv-swift), ms-swift's template for it, rollout batches.
PRELUDE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import numpy as np
    import torch
    from hpcrl_common.messages import PackedArray, RolloutBatch, RolloutSample
    from hpcrl_learner.batches import prepare_group

    tmp, model_dir = Path(sys.argv[1]), Path(sys.argv[2])
    VOCAB = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    PROMPT, GOOD, BAD = [5, 6, 7, 8], [10, 11, 12, 13, 2], [20, 21, 22, 2]

    def batch(batch_id, completions, rewards, logprobs=None, prompt=PROMPT):
        samples = []
        for i, (ids, reward) in enumerate(zip(completions, rewards)):
            lp = logprobs[i] if logprobs is not None else [-1.0 - 0.1 * k for k in range(len(ids))]
            samples.append(RolloutSample(
                candidate_id=f"{batch_id}/{i}", completion_token_ids=PackedArray.of(ids, "<i4"),
                sampling_logprobs=PackedArray.of(lp, "<f4"), policy_version=0,
                reward=float(reward), status="success"))
        return RolloutBatch(id=batch_id, experiment="t", iteration=0,
                            prompt_token_ids=PackedArray.of(prompt, "<i4"), samples=samples,
                            reward_mode="raw")

    def group(b):
        return prepare_group(b, 0, adv_eps=1e-4, vocab_size=VOCAB, max_sequence_tokens=4096)

    def template():
        from swift.model import get_processor
        from swift.template import get_template
        t = get_template(get_processor(str(model_dir), model_type="qwen2", download_model=False),
                         template_type="chatml")
        t.set_mode("train")
        return t
""")

CONVERT = textwrap.dedent("""
    from hpcrl_learner.backends.swift.convert import collate_step
    g1 = group(batch("a", [GOOD, BAD, GOOD, BAD], [3, 0, 2, 1]))
    g2 = group(batch("b", [[30, 31, 2], [40, 2], [50, 51, 52, 53, 54, 2]], [1, 0, 5],
                     prompt=[9, 8, 7, 6, 5, 4]))
    seqs = g1.sequences + g2.sequences
    step = collate_step(seqs, template(), dp_size=2, micro_batch_size=3)
    expected = {tuple(np.concatenate([s.prompt_ids, s.completion_ids]).tolist()): s for s in seqs}
    out = {"ranks": {r: len(m) for r, m in step.dispatch.items()}, "rows": [], "fillers": 0,
           "num_items": [float(b.num_items_in_batch) for b in step.grpo_batches],
           "tokens": step.tokens}
    for rank in sorted(step.dispatch):
        for inputs in step.dispatch[rank]:
            b = inputs["grpo_batch"]
            for row in range(inputs["input_ids"].shape[0]):
                length = int(inputs["attention_mask"][row].sum())
                ids = tuple(inputs["input_ids"][row, :length].tolist())
                mask = b.completion_mask[row]
                if not bool(mask.any()):
                    out["fillers"] += 1
                    assert float(b.advantages[row].abs().sum()) == 0.0
                    continue
                s = expected[ids]
                p, c = len(s.prompt_ids), len(s.completion_ids)
                positions = mask.nonzero(as_tuple=True)[0].tolist()
                rollout = b.rollout_per_token_logps
                out["rows"].append({
                    "positions_ok": positions == list(range(p - 1, p + c - 1)),
                    "targets_ok": inputs["input_ids"][row][[q + 1 for q in positions]].tolist()
                                  == s.completion_ids.tolist(),
                    "old_ok": np.allclose(b.old_per_token_logps[row, positions].numpy(),
                                          s.sampling_logprobs),
                    "rollout_ok": rollout is None or np.allclose(
                        rollout[row, positions].numpy(), s.sampling_logprobs),
                    "adv": sorted(set(round(float(a), 6) for a in b.advantages[row, positions])),
                    "adv_off_mask": float(b.advantages[row][~mask].abs().sum()),
                    "ids": list(ids),
                })
    # the same completion can occur twice in a group with different rewards: compare multisets
    out["sent"] = sorted([list(k), [round(s.advantage, 6)]] for k, s in
                         ((tuple(np.concatenate([s.prompt_ids, s.completion_ids]).tolist()), s)
                          for s in seqs))
    out["got"] = sorted([r["ids"], r["adv"]] for r in out["rows"])
    print(json.dumps(out))
""")

# A data-parallel worker group on the CPU with a real model: the same contract as ms-swift's
# WorkerGroup of MegatronWorker (dp-dispatched micro-batches in, rank-major rows out, the
# configured dapo loss of MegatronGRPOTrainer.loss_func), so the driver's frames and
# normalisation can be checked against our torch backend.
CPU_GROUP = textwrap.dedent("""
    import copy, math
    from transformers import AutoModelForCausalLM

    class CpuGroup:
        def __init__(self, settings, dp_size):
            torch.manual_seed(0)
            self.dp_size = dp_size
            self.settings = settings
            self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
            self.params = [p for p in self.model.parameters() if p.requires_grad]
            self.opt = torch.optim.AdamW(self.params, lr=settings.learning_rate,
                                         betas=settings.adam_betas,
                                         weight_decay=settings.weight_decay)
            self.iteration = 0
            self.saved = []

        def _logps(self, inputs):
            out = self.model(input_ids=inputs["input_ids"],
                             attention_mask=inputs["attention_mask"], use_cache=False)
            logp = torch.log_softmax(out.logits.float(), dim=-1)
            # full-sequence frame: position t scores token t + 1 (ms-swift's roll)
            targets = torch.roll(inputs["input_ids"], shifts=-1, dims=1)
            return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)

        def _batches(self, dispatch):
            return [mi for rank in sorted(dispatch) for mi in copy.deepcopy(dispatch[rank])]

        def compute_logps(self, dispatch):
            rows = []
            with torch.no_grad():
                for mi in self._batches(dispatch):
                    rows += [{"per_token_logps": r} for r in self._logps(mi)]
            return rows

        def compute_ref_logps(self, dispatch):
            raise AssertionError("beta = 0: no reference forward expected")

        def train_step(self, dispatch, extra_metrics=None):
            s = self.settings
            self.opt.zero_grad()
            total = 0.0
            for mi in self._batches(dispatch):
                b = mi.pop("grpo_batch")
                logp = self._logps(mi)
                mask = b.completion_mask.float()
                coef_1 = torch.exp(logp - b.old_per_token_logps)
                coef_2 = torch.clamp(coef_1, 1 - s.clip_eps, 1 + s.clip_eps)
                coef_1 = torch.clamp(coef_1, max=math.exp(s.max_log_ratio))
                per_token = -torch.min(coef_1 * b.advantages, coef_2 * b.advantages)
                loss = (per_token * mask).sum() / b.num_items_in_batch.clamp(min=1.0)
                loss.backward()
                total += float(loss)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, s.max_grad_norm))
            self.opt.step()
            self.iteration += 1
            return [{"iteration": self.iteration, "loss": total, "grad_norm": grad_norm,
                     "lr": s.learning_rate, "clip_ratio/region_mean": 0.0}] * self.dp_size

        def execute(self, method, *args):
            self.saved.append(method)
            if method == "save_hf_version":
                self.model.save_pretrained(args[0])
            elif method == "save_training_state":
                torch.save(self.opt.state_dict(), Path(args[0]) / "optimizer.pt")
""")

EQUIVALENCE = textwrap.dedent("""
    from hpcrl_learner.config import LearnerSettings
    from hpcrl_learner.backends.swift.driver import SwiftTrainer
    from hpcrl_learner.backends.torch import TorchTrainer

    aggregation = sys.argv[3]
    settings = LearnerSettings(model_path=model_dir, checkpoint_dir=tmp / "ck", learning_rate=1e-3,
                               micro_batch_size=3, aggregation=aggregation, max_log_ratio=2.0,
                               device="cpu", dtype="float32", autocast="off")
    torch_trainer = TorchTrainer(settings, seed=0)
    good_lp = torch_trainer.logprobs(group(batch("p", [GOOD], [0])).sequences)[0]
    # sampler log-probs: one token far off (masked by max_log_ratio), others nudged both ways
    shifted = good_lp.copy(); shifted[1] -= 5.0; shifted[0] += 0.5; shifted[2] -= 0.4
    g1 = group(batch("a", [GOOD, BAD, GOOD, BAD], [3, 0, 2, 1],
                     logprobs=[shifted, [-2.0] * 4, good_lp, [-9.0] * 4]))
    g2 = group(batch("b", [[30, 31, 2], [40, 2], [50, 51, 52, 53, 54, 2]], [1, 0, 5],
                     prompt=[9, 8, 7, 6, 5, 4]))
    seqs = g1.sequences + g2.sequences
    group_cpu = CpuGroup(settings, dp_size=2)
    swift_trainer = SwiftTrainer(settings, group_cpu, template(), vocab_size=VOCAB)
    m_swift = swift_trainer.step(seqs)
    m_torch = torch_trainer.step(seqs)
    diff = max(float((a - b).abs().max()) for a, b in
               zip(group_cpu.model.parameters(), torch_trainer.model.parameters()))
    swift_trainer.save_version(tmp / "v1"); (tmp / "state").mkdir()
    swift_trainer.save_optimizer(tmp / "state")
    print(json.dumps({"swift": m_swift.metrics(), "torch": m_torch.metrics(), "param_diff": diff,
                      "saved": group_cpu.saved,
                      "version_files": sorted(p.name for p in (tmp / "v1").iterdir())}))
""")

LEARNING = textwrap.dedent("""
    from hpcrl_learner.config import LearnerSettings
    from hpcrl_learner.backends.swift.driver import SwiftTrainer

    settings = LearnerSettings(model_path=model_dir, checkpoint_dir=tmp / "ck", learning_rate=3e-3,
                               micro_batch_size=2, device="cpu", dtype="float32")
    cpu = CpuGroup(settings, dp_size=1)
    trainer = SwiftTrainer(settings, cpu, template(), vocab_size=VOCAB)
    probe = group(batch("probe", [GOOD, BAD], [0, 0])).sequences

    def seq_logp():
        values = []
        with torch.no_grad():
            for s in probe:
                ids = torch.tensor([np.concatenate([s.prompt_ids, s.completion_ids])])
                logp = torch.log_softmax(cpu.model(input_ids=ids).logits[0, :-1], -1)
                targets = ids[0, 1:]
                per = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
                values.append(float(per[len(s.prompt_ids) - 1:].sum()))
        return values

    before = seq_logp()
    for i in range(6):
        good, bad = seq_logp()
        lp = {"good": [good / len(GOOD)] * len(GOOD), "bad": [bad / len(BAD)] * len(BAD)}
        g = group(batch(f"s{i}", [GOOD, BAD, GOOD, BAD], [100, -40, 100, -40],
                        logprobs=[lp["good"], lp["bad"], lp["good"], lp["bad"]]))
        trainer.step(g.sequences)
    print(json.dumps({"before": before, "after": seq_logp()}))
""")

IMPORTS = textwrap.dedent("""
    import ast, dataclasses
    import swift
    from swift.ray.megatron.megatron_worker import MegatronWorker
    from hpcrl_learner.config import LearnerSettings, LoraSettings
    from hpcrl_learner.backends.swift.cluster import megatron_args
    from hpcrl_learner.backends.swift.worker import HpcrlMegatronWorker

    # ms-swift's own MegatronRLHFArguments needs Megatron-Core to import; read its fields
    # (and those of its bases) from the installed source instead.
    root = Path(swift.__file__).parent
    fields = set()
    for f in [*(root / "megatron" / "arguments").rglob("*.py"),
              *(root / "arguments").rglob("*.py")]:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef):
                fields |= {b.target.id for b in node.body
                           if isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name)}
    full = megatron_args(LearnerSettings(model_path=model_dir, beta=0.04), output_dir=tmp)
    lora = megatron_args(LearnerSettings(model_path=model_dir, lora=LoraSettings(enabled=True),
                                         dtype="bfloat16", gradient_checkpointing=True),
                         tp=2, output_dir=tmp)
    from swift.ray.megatron.worker_group import _DC_ATTR
    decorated = {n: str(getattr(getattr(HpcrlMegatronWorker, n), _DC_ATTR, {}).get("dispatch"))
                 for n in ("train_step", "save_hf_version", "save_training_state")}
    print(json.dumps({"unknown": sorted((set(full) | set(lora)) - fields),
                      "subclass": issubclass(HpcrlMegatronWorker, MegatronWorker),
                      "decorated": decorated, "lora": lora, "full": full}))
""")


def run_in_swift_env(tmp_path: Path, model: Path, *parts: str, args: tuple[str, ...] = ()) -> dict:
    script = "\n".join([PRELUDE, *parts])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "services" / "learner" / "src"), str(ROOT / "libs" / "common" / "src")]
        ),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    done = subprocess.run(
        [str(SWIFT_PY), "-c", script, str(tmp_path), str(model), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_refuses_with_the_reason_where_swift_cannot_run(tiny_model, tmp_path):
    missing = missing_requirements()
    if not missing:
        pytest.skip("this host has everything the swift backend needs")
    settings = LearnerSettings(backend="swift", model_path=tiny_model, checkpoint_dir=tmp_path)
    with pytest.raises(SwiftUnavailable) as refused:
        swift_backend(settings, None, None, 0)
    message = str(refused.value)
    assert all(item in message for item in missing)
    assert "install-swift.sh" in message and "backend = 'torch'" in message


@needs_swift_env
def test_batches_become_exactly_what_the_megatron_worker_consumes(tiny_model, tmp_path):
    out = run_in_swift_env(tmp_path, tiny_model, CONVERT)
    assert out["ranks"] == {"0": 2, "1": 2}  # 7 sequences, 2 ranks x 2 micro-batches of 3
    assert out["fillers"] == 12 - 7
    assert len(out["rows"]) == 7
    for row in out["rows"]:
        assert row["positions_ok"] and row["targets_ok"], row
        assert row["old_ok"] and row["rollout_ok"], row
        assert row["adv_off_mask"] == 0.0, row
    assert out["got"] == out["sent"]  # every sequence once, its own advantage on every token
    tokens = 4 * 0 + 5 + 4 + 5 + 4 + 3 + 2 + 6
    assert out["tokens"] == tokens and set(out["num_items"]) == {float(tokens)}
    assert {adv[0] for _, adv in out["got"]} != {0.0}


@needs_swift_env
@pytest.mark.slow
@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_swift_step_equals_the_torch_backend_step(tiny_model, tmp_path, aggregation):
    out = run_in_swift_env(tmp_path, tiny_model, CPU_GROUP, EQUIVALENCE, args=(aggregation,))
    swift, torch_ = out["swift"], out["torch"]
    assert swift["loss"] == pytest.approx(torch_["loss"], rel=1e-4, abs=1e-6)
    assert swift["grad_norm"] == pytest.approx(torch_["grad_norm"], rel=1e-4)
    assert swift["sampler_kl"] == pytest.approx(torch_["sampler_kl"], rel=1e-4)
    assert swift["masked_fraction"] == pytest.approx(torch_["masked_fraction"])
    assert swift["masked_fraction"] > 0  # the far-off token was masked by both
    assert swift["tokens"] == torch_["tokens"]
    # AdamW moves every weight by about lr = 1e-3; the two layouts (right- vs left-padded,
    # different micro-batches) differ only by float rounding, far below one step.
    assert out["param_diff"] < 1e-5
    assert out["saved"] == ["save_hf_version", "save_training_state"]
    assert "model.safetensors" in out["version_files"] and "config.json" in out["version_files"]


@needs_swift_env
@pytest.mark.slow
def test_swift_driver_learns_the_favoured_completion(tiny_model, tmp_path):
    out = run_in_swift_env(tmp_path, tiny_model, CPU_GROUP, LEARNING)
    (good0, bad0), (good1, bad1) = out["before"], out["after"]
    assert good1 > good0 + 0.5
    assert bad1 < bad0 - 0.5


@needs_swift_env
def test_megatron_worker_and_arguments_match_ms_swift(tiny_model, tmp_path):
    out = run_in_swift_env(tmp_path, tiny_model, IMPORTS)
    assert out["unknown"] == []  # every argument we pass is one ms-swift 4.6.0 defines
    assert out["subclass"]
    assert out["decorated"] == {
        "train_step": "DispatchMode.DP",
        "save_hf_version": "DispatchMode.BROADCAST",
        "save_training_state": "DispatchMode.BROADCAST",
    }
    assert out["full"]["tuner_type"] == "full" and out["full"]["beta"] == 0.04
    assert out["lora"]["tuner_type"] == "lora" and out["lora"]["lora_rank"] == 16
    assert out["lora"]["tensor_model_parallel_size"] == 2 and out["lora"]["bf16"] is True
    assert out["lora"]["recompute_granularity"] == "full"
    assert out["full"]["loss_type"] == "dapo"


def test_gpu_route_trains_a_step(tiny_model, tmp_path):
    missing = missing_requirements()
    if missing:
        pytest.skip(f"the swift GPU route needs {', '.join(missing)} (none lent to this run)")
    from hpcrl_learner.batches import prepare_group

    from .conftest import good_bad_batch

    settings = LearnerSettings(
        backend="swift",
        model_path=tiny_model,
        checkpoint_dir=tmp_path,
        learning_rate=1e-3,
        micro_batch_size=2,
    )
    trainer = swift_backend(settings, None, None, 0)
    group = prepare_group(
        good_bad_batch("gpu"),
        0,
        adv_eps=1e-4,
        vocab_size=trainer.vocab_size,
        max_sequence_tokens=4096,
    )
    metrics = trainer.step(group.sequences)
    assert metrics.tokens == 18 and metrics.grad_norm > 0
    trainer.save_version(tmp_path / "v1")
    assert (tmp_path / "v1" / "config.json").exists()
