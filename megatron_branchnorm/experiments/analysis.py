"""Layer-wise analyses of a trained model (BranchNorm paper, Liu et al., Figs. 8 and 9), on
held-out sentences, teacher-forced through the flat model of an export directory.

    batches = heldout_batches(model, sp, "runs/study/data", "test", max_sentences=200)
    stats = analyze(model, batches)
    stats["encoder"]["cosine"][i], stats["decoder"]["sparsity"][i]    # layer i + 1

Definitions (per stack, layer i = 1..N; every average is over the non-padding tokens):
- cosine: the cosine similarity between a token's representation entering layer i (the
  embedding for i = 1) and leaving it, i.e. between adjacent layers' outputs;
- sparsity: the fraction of the FFN's hidden activations that are zero after the activation,
  i.e. of fc1 outputs <= 0 (ReLU(z) = 0 exactly when z <= 0; for GELU, the share of
  non-positive outputs), over every hidden unit of every token;
- nll: the teacher-forced per-target-token negative log-likelihood (no smoothing), to show
  how far each model has trained.

An export folds BranchNorm and DeepNorm into a plain Post-LN model; the folding rescales only
the sublayers' output projections, so every layer output (a LayerNorm output) and every fc1
activation are those of the model as trained (exact for BranchNorm, up to LN's epsilon for
DeepNorm). For Pre-LN the layer outputs are the un-normalised residual stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from megatron_branchnorm.data.text import clean
from megatron_branchnorm.errors import UserError
from megatron_branchnorm.model import EncoderDecoder
from megatron_branchnorm.model.loss import label_smoothed_nll_loss
from megatron_branchnorm.tokens import BOS_ID, EOS_ID, PAD_ID

STACKS = ("encoder", "decoder")


class AnalysisError(UserError, ValueError):
    """Bad analysis input: a one-line message naming the file or option."""


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(src_tokens (B, S), prev_output_tokens (B, T), target (B, T)), padded with PAD_ID."""


def pad_batch(pairs: Sequence[tuple[list[int], list[int]]]) -> Batch:
    """Teacher-forcing tensors of (source ids, target ids without BOS/EOS) pairs."""
    width_s = max(len(s) for s, _ in pairs)
    width_t = max(len(t) for _, t in pairs) + 1
    src = torch.full((len(pairs), width_s), PAD_ID, dtype=torch.long)
    prev = torch.full((len(pairs), width_t), PAD_ID, dtype=torch.long)
    tgt = torch.full((len(pairs), width_t), PAD_ID, dtype=torch.long)
    for i, (s, t) in enumerate(pairs):
        src[i, : len(s)] = torch.tensor(s)
        prev[i, : len(t) + 1] = torch.tensor([BOS_ID, *t])
        tgt[i, : len(t) + 1] = torch.tensor([*t, EOS_ID])
    return src, prev, tgt


def heldout_batches(
    model: EncoderDecoder,
    sp: Any,
    data_dir: str | Path,
    split: str,
    max_sentences: int = 200,
    batch_tokens: int = 2048,
) -> tuple[list[Batch], dict[str, int]]:
    """Batches of the first ``max_sentences`` pairs of every direction of a DATA_DIR's raw
    ``split`` references (source ``<2tgt> pieces </s>``, as in translation), and the number of
    sentences per direction. Sequences are cut to the model's position table."""
    from megatron_branchnorm.inference.evaluate import read_lines, references_from_manifest
    from megatron_branchnorm.inference.translate import language_tags

    if max_sentences < 1:
        raise AnalysisError(f"--max-sentences must be >= 1, got {max_sentences}")
    if sp is None:
        raise AnalysisError("the export has no spm.model: cannot tokenise the held-out text")
    tags = language_tags(sp)
    limit = model.cfg.max_positions - 1
    pairs: list[tuple[list[int], list[int]]] = []
    counts: dict[str, int] = {}
    for name, d in references_from_manifest(data_dir, split).items():
        if d.tgt_lang not in tags:
            raise AnalysisError(
                f"{name}: the export's spm.model has no tag <2{d.tgt_lang}> "
                f"(languages: {', '.join(sorted(tags)) or 'none'})"
            )
        src_lines, tgt_lines = read_lines(d.src_path), read_lines(d.ref_path)
        if len(src_lines) != len(tgt_lines):
            raise AnalysisError(
                f"{d.ref_path}: {len(tgt_lines)} lines but {d.src_path} has {len(src_lines)}"
            )
        n = 0
        for s_line, t_line in zip(src_lines, tgt_lines, strict=True):
            if n >= max_sentences:
                break
            s_ids = sp.encode(clean(s_line))
            t_ids = sp.encode(clean(t_line))
            if not s_ids or not t_ids:
                continue
            pairs.append(([tags[d.tgt_lang], *s_ids[: limit - 1], EOS_ID], t_ids[:limit]))
            n += 1
        counts[name] = n
    if not pairs:
        raise AnalysisError(f"{data_dir}: no non-empty {split} sentence pairs")
    order = sorted(range(len(pairs)), key=lambda i: -max(len(pairs[i][0]), len(pairs[i][1])))
    batches: list[Batch] = []
    current: list[tuple[list[int], list[int]]] = []
    for i in order:
        width = max(len(current[0][0]), len(current[0][1]) + 1) if current else 0
        if current and width * (len(current) + 1) > batch_tokens:
            batches.append(pad_batch(current))
            current = []
        current.append(pairs[i])
    batches.append(pad_batch(current))
    return batches, counts


class _Accumulator:
    """Sums of per-token cosines and FFN zero counts per layer of one stack."""

    def __init__(self, layers: int) -> None:
        self.cos = torch.zeros(layers, dtype=torch.float64)
        self.zeros = torch.zeros(layers, dtype=torch.float64)
        self.units = torch.zeros(layers, dtype=torch.float64)
        self.tokens = 0.0
        self.mask: torch.Tensor | None = None  # (B, T) True at real tokens, set per batch

    def layer_hook(self, i: int):
        def hook(module, inputs, output):  # noqa: ARG001
            cos = F.cosine_similarity(inputs[0].double(), output.double(), dim=-1)  # (B, T)
            self.cos[i] += cos[self.mask].sum()

        return hook

    def fc1_hook(self, i: int):
        def hook(module, inputs, output):  # noqa: ARG001
            z = output[self.mask]  # (tokens, H)
            self.zeros[i] += (z <= 0).sum().double()
            self.units[i] += z.numel()

        return hook

    def result(self) -> dict[str, list[float]]:
        return {
            "cosine": (self.cos / max(self.tokens, 1.0)).tolist(),
            "sparsity": (self.zeros / self.units.clamp(min=1.0)).tolist(),
        }


@torch.no_grad()
def analyze(model: EncoderDecoder, batches: Sequence[Batch]) -> dict[str, Any]:
    """Per-layer cosine and FFN sparsity of both stacks (module docstring), and the
    teacher-forced nll, over ``batches`` (the model is run in eval mode)."""
    was_training = model.training
    model.eval()
    acc = {
        "encoder": _Accumulator(len(model.encoder_layers)),
        "decoder": _Accumulator(len(model.decoder_layers)),
    }
    handles = []
    for stack, layers in (("encoder", model.encoder_layers), ("decoder", model.decoder_layers)):
        for i, layer in enumerate(layers):
            handles.append(layer.register_forward_hook(acc[stack].layer_hook(i)))
            handles.append(layer.ffn.fc1.register_forward_hook(acc[stack].fc1_hook(i)))
    nll_sum, n_tgt, n_src = 0.0, 0, 0
    try:
        for src, prev, tgt in batches:
            acc["encoder"].mask = src.ne(PAD_ID)
            acc["decoder"].mask = prev.ne(PAD_ID)
            logits = model(src, prev)  # (B, T, V)
            acc["encoder"].tokens += float(acc["encoder"].mask.sum())
            acc["decoder"].tokens += float(acc["decoder"].mask.sum())
            nll = F.cross_entropy(
                logits.double().flatten(0, 1), tgt.flatten(), ignore_index=PAD_ID, reduction="sum"
            )
            nll_sum += float(nll)
            n_tgt += int(tgt.ne(PAD_ID).sum())
            n_src += int(src.ne(PAD_ID).sum())
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    out: dict[str, Any] = {stack: acc[stack].result() for stack in STACKS}
    out.update({"nll": nll_sum / max(n_tgt, 1), "source_tokens": n_src, "target_tokens": n_tgt})
    return out


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------


def shown_layers(n: int, every: int | None = None) -> list[int]:
    """0-based layers a table shows: every ``every``-th (default: about 12 rows) and the last."""
    step = every or max(1, -(-n // 12))
    rows = list(range(0, n, step))
    if rows[-1] != n - 1:
        rows.append(n - 1)
    return rows


def format_table(results: list[tuple[str, dict[str, Any]]], every: int | None = None) -> str:
    """Markdown: per stack and layer, cosine and sparsity of each labelled model, then nll."""
    labels = [label for label, _ in results]
    head = (
        "| stack | layer | "
        + " | ".join(f"cos {x}" for x in labels)
        + " | "
        + " | ".join(f"sparsity {x}" for x in labels)
        + " |"
    )
    lines = [head, "|---|---|" + "---|" * (2 * len(labels))]
    for stack in STACKS:
        depth = max(len(r[stack]["cosine"]) for _, r in results)
        for i in shown_layers(depth, every):
            cells = []
            for key in ("cosine", "sparsity"):
                for _, r in results:
                    vals = r[stack][key]
                    cells.append(f"{vals[i]:.3f}" if i < len(vals) else "-")
            lines.append(f"| {stack} | {i + 1} | " + " | ".join(cells) + " |")
    for key, name in (("cosine", "mean cos"), ("sparsity", "mean sparsity")):
        for stack in STACKS:
            cells = []
            for _, r in results:
                vals = r[stack][key]
                cells.append(f"{sum(vals) / len(vals):.3f}")
            lines.append(f"| {stack} | {name} | " + " | ".join(cells) + " |")
    lines.append(
        "\nteacher-forced nll per target token: "
        + ", ".join(f"{label} {r['nll']:.3f}" for label, r in results)
    )
    return "\n".join(lines)


def plot_analysis(results: list[tuple[str, dict[str, Any]]], output: str | Path) -> Path:
    """PNG, 2x2: encoder/decoder cosine (top) and FFN sparsity (bottom) against the layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), constrained_layout=True)
    for row, (key, title) in enumerate(
        (("cosine", "cosine similarity of adjacent layers"), ("sparsity", "FFN sparsity"))
    ):
        for col, stack in enumerate(STACKS):
            ax = axes[row][col]
            for label, r in results:
                vals = r[stack][key]
                marker = "o" if len(vals) <= 24 else None
                ax.plot(range(1, len(vals) + 1), vals, marker=marker, markersize=3, label=label)
            ax.set_title(f"{stack}: {title}")
            ax.set_xlabel("layer")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.tmp{out.suffix}")
    fig.savefig(tmp, dpi=80)
    plt.close(fig)
    tmp.replace(out)
    return out


def source_dependence(
    model: EncoderDecoder, batches: Sequence[dict[str, Any]], seed: int = 0
) -> dict[str, float]:
    """Teacher-forced NLL per target token (nats) with the true source ("true"), the sources
    shuffled across each batch ("shuffled") and only the language tag ("empty"): a model that
    has only learnt a target-side language model scores the three alike."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in ("true", "shuffled", "empty"):
        # summed on the model's device in float64 (the same sums as Python floats), read once
        total = count = torch.zeros((), dtype=torch.float64)
        with torch.no_grad():
            for b in batches:
                src = b["src_tokens"]
                if name == "shuffled":
                    src = src[torch.randperm(src.shape[0], generator=gen)]
                elif name == "empty":  # keep the target-language tag, then end of sentence
                    src = torch.cat([src[:, :1], torch.full_like(src[:, :1], EOS_ID)], dim=1)
                logits = model(src, b["prev_output_tokens"])
                _, nll, n = label_smoothed_nll_loss(logits, b["target"], 0.0)
                total = total.to(nll.device) + nll.double()
                count = count.to(nll.device) + n.double()
        out[name] = float(total) / float(count)
    return out
