"""The model-step benchmark: the same configuration built by each implementation, and one
training-step loop shared by all of them (forward, the same label-smoothed loss, backward,
a plain ``torch.optim.Adam`` step), so a comparison compares models.

Imports only torch at module level: it runs both in the project's environment (``ours``,
``torch``) and in the anchors' throwaway environment (``fairseq``, ``torchscale``; see
bench_anchors.py). As a worker it serves timing requests over stdin/stdout (JSON lines), so
one orchestrator can interleave implementations and repeats in one run:

    python tools/_bench_models.py --impl torch --layers 12     # then {"dtype": "fp32", "steps": 3}
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import importlib.util
import json
import math
import sys
import time
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

IMPLS = ("ours", "torch", "fairseq", "torchscale")
PAD = 1  # fairseq's padding index; token ids >= 4 are words in every implementation


def model_flops(layers: int, dim: int, ffn: int, vocab: int, batch: int, src: int, tgt: int):
    """Matmul FLOPs of one training step (forward + backward = 3x forward) of an L-L
    encoder-decoder on a (batch, src) -> (batch, tgt) batch; attention scores included
    (planner.matmul_flops, which train.py's ``tflops_per_gpu`` counts too)."""
    from megatron_branchnorm.parallel.planner import matmul_flops

    return matmul_flops(layers, layers, dim, ffn, vocab, batch * src, batch * tgt, batch)


def reference_loss(logits: torch.Tensor, target: torch.Tensor, eps: float = 0.1) -> torch.Tensor:
    """fairseq's label-smoothed cross entropy (sum over tokens), in fp32: the one loss every
    implementation's model step uses."""
    lprobs = F.log_softmax(logits.float(), dim=-1).view(-1, logits.shape[-1])
    target = target.reshape(-1)
    nll = -lprobs.gather(1, target[:, None]).squeeze(1)
    smooth = -lprobs.sum(-1)
    eps_i = eps / (lprobs.shape[-1] - 1)
    return ((1.0 - eps - eps_i) * nll + eps_i * smooth).sum()


def make_batch(batch: int, src: int, tgt: int, vocab: int, seed: int = 0):
    """Random (src_tokens, prev_output_tokens, target) of word ids, no padding."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(4, vocab, (batch, src), generator=g)
    t = torch.randint(4, vocab, (batch, tgt + 1), generator=g)
    return s, t[:, :-1].contiguous(), t[:, 1:].contiguous()


# ---------------------------------------------------------------------------------------------
# The implementations: each returns a module with forward(src, prev) -> logits (B, T, V)
# ---------------------------------------------------------------------------------------------


def import_tree(root: str, names: list[str]) -> list[ModuleType]:
    """The modules ``names`` of the package under ``root`` (another git revision of this
    repository), imported under their usual names and then taken out of ``sys.modules`` again,
    so that this tree's modules stay the ones imported by name. Their functions keep their own
    module globals, so the two versions run side by side in one process."""

    def ours_loaded() -> dict:
        return {k: m for k, m in sys.modules.items() if k.split(".")[0] == "megatron_branchnorm"}

    saved = ours_loaded()
    for k in saved:
        del sys.modules[k]
    try:
        spec = importlib.machinery.PathFinder.find_spec("megatron_branchnorm", [root])
        if spec is None or spec.loader is None:
            raise ImportError(f"{root}: no megatron_branchnorm package")
        package = importlib.util.module_from_spec(spec)
        sys.modules["megatron_branchnorm"] = package
        spec.loader.exec_module(package)
        return [importlib.import_module(name) for name in names]
    finally:
        for k in ours_loaded():
            del sys.modules[k]
        sys.modules.update(saved)


def build_ours(a: argparse.Namespace) -> nn.Module:
    """Our model; with ``--root``, the package of that tree (another revision)."""
    if getattr(a, "root", None):
        config, model = import_tree(
            a.root, ["megatron_branchnorm.config", "megatron_branchnorm.model"]
        )
        ModelConfig, build_model = config.ModelConfig, model.build_model  # noqa: N806
    else:
        from megatron_branchnorm.config import ModelConfig
        from megatron_branchnorm.model import build_model

    cfg = ModelConfig(
        encoder_layers=a.layers, decoder_layers=a.layers, hidden_size=a.dim,
        ffn_hidden_size=a.ffn, num_attention_heads=a.heads, vocab_size=a.vocab,
        residual=a.residual, dropout=a.dropout, max_positions=max(a.src, a.tgt) + 8,
    )  # fmt: skip
    return build_model(cfg)


class TorchTransformer(nn.Module):
    """torch.nn.Transformer (Post-LN) with shared scaled embeddings, sinusoidal positions
    and a tied output projection."""

    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__()
        self.embed = nn.Embedding(a.vocab, a.dim, padding_idx=PAD)
        nn.init.normal_(self.embed.weight, 0, a.dim**-0.5)
        self.scale = math.sqrt(a.dim)
        half = a.dim // 2
        freq = torch.exp(torch.arange(half) * (-math.log(10000.0) / half))
        ang = torch.arange(1024)[:, None] * freq[None]
        self.register_buffer("pos", torch.cat([ang.sin(), ang.cos()], 1), persistent=False)
        self.drop = nn.Dropout(a.dropout)
        self.tf = nn.Transformer(
            a.dim, a.heads, a.layers, a.layers, a.ffn, a.dropout, batch_first=True
        )

    def _emb(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.drop(self.scale * self.embed(tokens) + self.pos[: tokens.shape[1]])

    def forward(self, src: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        t = prev.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(
            t, device=prev.device, dtype=torch.float32
        )
        y = self.tf(self._emb(src), self._emb(prev), tgt_mask=mask, tgt_is_causal=True)
        return y @ self.embed.weight.t()


class FairseqWrapper(nn.Module):
    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__()
        from fairseq.data import Dictionary
        from fairseq.models.transformer import TransformerConfig, TransformerModelBase

        d = Dictionary()
        for i in range(a.vocab - len(d)):
            d.add_symbol(f"w{i}")

        class Task:
            source_dictionary = target_dictionary = d

        cfg = TransformerConfig()
        cfg.encoder.embed_dim = cfg.decoder.embed_dim = a.dim
        cfg.encoder.ffn_embed_dim = cfg.decoder.ffn_embed_dim = a.ffn
        cfg.encoder.attention_heads = cfg.decoder.attention_heads = a.heads
        cfg.encoder.layers = cfg.decoder.layers = a.layers
        cfg.decoder.input_dim = cfg.decoder.output_dim = a.dim
        cfg.share_all_embeddings = True
        cfg.dropout = a.dropout
        cfg.max_source_positions = cfg.max_target_positions = 1024
        self.model = TransformerModelBase.build_model(cfg, Task())

    def forward(self, src: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        lengths = torch.full((src.shape[0],), src.shape[1], dtype=torch.long)
        return self.model(src, lengths, prev)[0]


class TorchscaleWrapper(nn.Module):
    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__()
        from torchscale.architecture.config import EncoderDecoderConfig
        from torchscale.architecture.encoder_decoder import EncoderDecoder
        from torchscale.component.embedding import PositionalEmbedding, TextEmbedding

        cfg = EncoderDecoderConfig(
            vocab_size=a.vocab, deepnorm=True, encoder_layers=a.layers, decoder_layers=a.layers,
            encoder_embed_dim=a.dim, decoder_embed_dim=a.dim, encoder_ffn_embed_dim=a.ffn,
            decoder_ffn_embed_dim=a.ffn, encoder_attention_heads=a.heads,
            decoder_attention_heads=a.heads, dropout=a.dropout, share_all_embeddings=True,
            share_decoder_input_output_embed=True, no_scale_embedding=False,
        )  # fmt: skip
        emb = TextEmbedding(a.vocab, a.dim, padding_idx=PAD)
        self.model = EncoderDecoder(
            cfg,
            encoder_embed_tokens=emb,
            encoder_embed_positions=PositionalEmbedding(1024, a.dim, padding_idx=PAD),
            decoder_embed_tokens=emb,
            decoder_embed_positions=PositionalEmbedding(1024, a.dim, padding_idx=PAD),
        )

    def forward(self, src: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return self.model(src, prev)[0]


BUILDERS = {
    "ours": build_ours,
    "torch": TorchTransformer,
    "fairseq": FairseqWrapper,
    "torchscale": TorchscaleWrapper,
}


# ---------------------------------------------------------------------------------------------
# The shared step and the worker loop
# ---------------------------------------------------------------------------------------------


def train_step(model, opt, batch, bf16: bool) -> float:
    """One forward + loss + backward + Adam step; returns the loss (a host sync per step)."""
    src, prev, target = batch
    with torch.autocast(src.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(src, prev)  # (B, T, V)
    loss = reference_loss(logits, target)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss)


def serve(a: argparse.Namespace) -> None:
    """Build the model, then answer {"dtype", "steps"} lines with per-step seconds."""
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = BUILDERS[a.impl](a).to(a.device)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98))
    batch = tuple(x.to(a.device) for x in make_batch(a.batch, a.src, a.tgt, a.vocab))
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"ready": a.impl, "params": params, "build_s": time.perf_counter() - t0}))
    sys.stdout.flush()
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("quit"):
            break
        times, losses = [], []
        for _ in range(req["steps"]):
            t0 = time.perf_counter()
            losses.append(train_step(model, opt, batch, req["dtype"] == "bf16"))
            times.append(time.perf_counter() - t0)
        print(json.dumps({"times": times, "loss": losses[-1]}))
        sys.stdout.flush()


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The shared configuration (12L-12L, d=256, FFN 1024, 4 heads, 8k vocab,
    2048 + 2048 tokens per step, dropout 0.1)."""
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--src", type=int, default=32)
    p.add_argument("--tgt", type=int, default=32)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--residual", default="branchnorm", help="ours only")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu or cuda (model section only)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", choices=IMPLS, required=True)
    p.add_argument("--root", default=None, help="ours: import the package from this tree")
    add_model_args(p)
    serve(p.parse_args())


if __name__ == "__main__":
    main()
