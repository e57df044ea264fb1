"""Which policy version to load next, and whether a checkpoint is safe to load.

A failed in-place reload can leave an inference engine dead (vLLM does), so a version is
validated before any backend sees it: its checksum matches the announcement, and its tensors
have exactly the names and shapes of the model already running.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

from hpcrl_common.checkpoints import CheckpointInfo, CheckpointStore, checksum_dir, split_run
from hpcrl_common.messages import WeightUpdate
from hpcrl_generator.sampling import WeightFormat

# Config keys that fix the shapes of a model; a checkpoint that differs in any is refused.
SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)


class CheckpointError(ValueError):
    """A version that must not be loaded (the running policy stays)."""


@dataclass(frozen=True)
class Target:
    """A policy version to load: where it is and what its contents must hash to."""

    version: int
    path: Path
    format: WeightFormat
    checksum: str

    @classmethod
    def from_info(cls, info: CheckpointInfo, store: CheckpointStore) -> Target:
        return cls(info.version, store.path_of(info).resolve(), info.format, info.checksum)

    @classmethod
    def from_update(cls, update: WeightUpdate, store: CheckpointStore | None) -> Target:
        """The announced version as this replica's own store lists it.

        Only the version number is taken from the message: the path and checksum come from
        the manifest of the configured store, so an announcement cannot point anywhere else,
        and one that disagrees with the manifest (forged, replayed from another run) is
        refused with a :class:`Refused` reason.
        """
        if store is None:
            raise Refused(
                "no_store",
                "generator.checkpoint_dir is not set: announcements "
                "cannot be checked, so none is loaded",
            )
        _experiment, announced_run = split_run(update.run)
        if store.run_id is not None and announced_run != store.run_id:
            raise Refused(
                "other_run",
                f"version {update.version} belongs to run "
                f"{update.run!r}, this store is run {store.run_id!r}",
            )
        try:
            info = store.get(update.version)
        except KeyError:
            raise Refused(
                "not_in_store", f"version {update.version} is not in the manifest of {store.root}"
            ) from None
        if info.checksum != update.checksum or info.format != update.format:
            raise Refused(
                "mismatch",
                f"version {update.version}: the announcement's "
                f"{update.format} {update.checksum} differs from the manifest's "
                f"{info.format} {info.checksum}",
            )
        return cls.from_info(info, store)


class Refused(CheckpointError):
    """An announcement that does not match this replica's checkpoint store."""

    def __init__(self, reason: str, text: str) -> None:
        super().__init__(text)
        self.reason = reason


@dataclass(frozen=True)
class ModelSignature:
    """What a full checkpoint must match to be loaded into a running engine."""

    config: dict[str, object]
    tensors: dict[str, tuple[int, ...]]

    @classmethod
    def of(cls, model_dir: Path) -> ModelSignature:
        return cls(_shape_config(model_dir), tensor_shapes(model_dir))

    def check(self, model_dir: Path) -> None:
        config = _shape_config(model_dir)
        for key in SHAPE_KEYS:
            if config.get(key) != self.config.get(key):
                raise CheckpointError(
                    f"{model_dir}: config {key} is {config.get(key)!r}, "
                    f"the running model has {self.config.get(key)!r}"
                )
        tensors = tensor_shapes(model_dir)
        missing = sorted(set(self.tensors) - set(tensors))
        extra = sorted(set(tensors) - set(self.tensors))
        if missing or extra:
            raise CheckpointError(
                f"{model_dir}: tensors differ from the running model "
                f"(missing {missing[:5]}, unexpected {extra[:5]})"
            )
        for name, shape in tensors.items():
            if shape != self.tensors[name]:
                raise CheckpointError(
                    f"{model_dir}: tensor {name} has shape {shape}, expected {self.tensors[name]}"
                )


def _shape_config(model_dir: Path) -> dict[str, object]:
    path = model_dir / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{model_dir}: no config.json") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not JSON ({exc})") from None
    text = raw.get("text_config", raw)  # multimodal configs nest the language model
    return {key: text.get(key) for key in SHAPE_KEYS}


def tensor_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of every tensor in the directory's safetensors files (headers only)."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files")
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(file, framework="numpy") as handle:
                for name in handle.keys():  # noqa: SIM118 (not a dict)
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
        except Exception as exc:  # a truncated or corrupt file
            raise CheckpointError(f"{file}: unreadable safetensors ({exc})") from None
    return shapes


def check_lora(adapter_dir: Path) -> None:
    for name in ("adapter_config.json",):
        if not (adapter_dir / name).is_file():
            raise CheckpointError(f"{adapter_dir}: LoRA version without {name}")
    if not list(adapter_dir.glob("adapter_model.*")):
        raise CheckpointError(f"{adapter_dir}: LoRA version without adapter_model weights")


def validate(target: Target, signature: ModelSignature, *, verify_checksum: bool) -> None:
    """Raise CheckpointError unless ``target`` can be loaded into the running model."""
    if not target.path.is_dir():
        raise CheckpointError(f"version {target.version}: {target.path} is not a directory")
    if verify_checksum:
        actual = checksum_dir(target.path)
        if actual != target.checksum:
            raise CheckpointError(
                f"version {target.version}: checksum of {target.path} is {actual}, "
                f"announced {target.checksum}"
            )
    if target.format == "full":
        signature.check(target.path)
    else:
        check_lora(target.path)


class VersionTracker:
    """The loaded version and the newest one offered (announced or found in the manifest).

    Thread-safe: the weight-updates handler offers, the sampling thread takes. A version
    that failed validation is remembered and never offered again (its checksum cannot
    change: versions are immutable once committed).
    """

    def __init__(self, loaded: int = 0) -> None:
        self._lock = threading.Lock()
        self.loaded = loaded
        self._pending: Target | None = None
        self._refused: set[int] = set()

    def offer(self, target: Target) -> bool:
        """Keep ``target`` if it is newer than both the loaded and the pending version."""
        with self._lock:
            if target.version <= self.loaded or target.version in self._refused:
                return False
            if self._pending is not None and target.version <= self._pending.version:
                return False
            self._pending = target
            return True

    def take(self) -> Target | None:
        with self._lock:
            target, self._pending = self._pending, None
            if target is not None and target.version <= self.loaded:
                return None
            return target

    def loaded_ok(self, version: int) -> None:
        with self._lock:
            self.loaded = max(self.loaded, version)

    def refused(self, version: int) -> None:
        with self._lock:
            self._refused.add(version)

    @property
    def pending_version(self) -> int | None:
        with self._lock:
            return None if self._pending is None else self._pending.version
