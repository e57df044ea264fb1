"""Code that runs inside vLLM's worker processes (named by `worker_extension_cls`).

Kept free of hpcrl imports beyond the standard library: vLLM imports it by qualified name in
every worker.
"""

from __future__ import annotations


class ReloadExtension:
    """Mixed into vLLM's worker class: in-place reload that keeps tied embeddings tied."""

    def hpcrl_reload_weights(self, weights_path: str) -> bool:
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        return self.hpcrl_retie_embeddings()

    def hpcrl_retie_embeddings(self) -> bool:
        """Point lm_head at the embedding again after a reload, and re-derive its kernels.

        With tie_word_embeddings (Qwen2.5 0.5B/1.5B, our tiny models) vLLM's layer-wise
        reload finds no `lm_head.weight` in the checkpoint and puts the output layer's old
        tensor back, so the policy would sample from a mix of two versions. On CPU the output
        layer also keeps a prepacked copy of its weight (oneDNN / sgl GEMM), built by
        `process_weights_after_loading`; that is rebuilt from the re-tied weight.
        """
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        config = getattr(model, "config", None)
        if not getattr(config, "tie_word_embeddings", False):
            return False
        lm_head = getattr(model, "lm_head", None)
        inner = getattr(model, "model", None)
        embed = getattr(inner, "embed_tokens", None)
        if lm_head is None or embed is None or not hasattr(lm_head, "weight"):
            return False
        lm_head.weight = embed.weight
        quant_method = getattr(lm_head, "quant_method", None)
        if quant_method is not None:
            quant_method.process_weights_after_loading(lm_head)
        return True

    def hpcrl_weight_fingerprint(self) -> list[float]:
        """Sums of the embedding and output layer (tests check they agree after a reload)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return [
            float(model.model.embed_tokens.weight.double().sum()),
            float(model.lm_head.weight.double().sum()),
        ]
