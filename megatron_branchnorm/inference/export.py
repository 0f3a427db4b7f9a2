"""The export directory: what users exchange and what translate.py / evaluate.py load.

    EXPORT_DIR/
      model.safetensors   flat state dict of the (folded) model; the shared embedding once
      config.yaml         ``model:`` section (residual "postln" once a Post-LN-family scheme is folded)
      spm.model           the joint SentencePiece model (when one was given)
      export.json         provenance: source checkpoint, step, alpha, original scheme, languages,
                          and the sha256 of every file above

    save_export(model, "exports/run1", "data/spm.model", {"source_checkpoint": ..., "languages": [...]})
    model, sp, meta = load_export("exports/run1")

Loading never unpickles anything: weights come from safetensors, the rest is YAML and JSON.
Every file it opens or hashes (the fixed names above, the names export.json's ``sha256``
lists) is a regular file inside the export, not a link (``formats.files.file_inside``): an
export never makes us stat, hash or read another file of the machine.
config.yaml is checked against the safetensors header (tensor names, shapes, dtypes) before
the model is built, so an export whose config disagrees with its weights allocates nothing.
A Post-LN-family model (postln, deepnorm, branchnorm at its current step: a scheme that is
``foldable_to_postln``, model/residual.py) is folded into a vanilla Post-LN model before
saving; a Pre-LN model is saved as Pre-LN.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from megatron_branchnorm.config import ConfigError, ModelConfig
from megatron_branchnorm.config import model_config_from_dict as parse_model_config
from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats import dirs
from megatron_branchnorm.formats.files import (
    FileShapeError,
    file_inside,
    one_line,
    quote,
    read_json_object,
    read_small_file,
    sha256_file,
)
from megatron_branchnorm.formats.outputs import (
    OutputError,
    json_has_format,
    prepare_output,
    publish_dir,
    temp_dir_beside,
    write_failure_reason,
    write_marker,
)
from megatron_branchnorm.formats.yaml_io import MAX_BYTES as YAML_MAX_BYTES
from megatron_branchnorm.formats.yaml_io import YAMLLimitError, load_bounded
from megatron_branchnorm.model import EncoderDecoder, build_model
from megatron_branchnorm.model.encoder_decoder import as_postln
from megatron_branchnorm.model.residual import branch_scale_at, residual_constants, scheme_of

WEIGHTS = "model.safetensors"
CONFIG = "config.yaml"
SPM = "spm.model"
META = dirs.EXPORT_META
EXPORT_FORMAT = dirs.EXPORT_FORMAT
EXPORT_VERSION = 1
EXPORT_KIND = dirs.EXPORT.name
"""Marker kind of an export directory (outputs.MARKER; formats/dirs.py owns its layout)."""
EXPORT_TOOL = "convert_checkpoint"
MAX_EXPORT_POSITIONS = 1 << 16
"""Largest ``model.max_positions`` an export may declare: its position tables are not stored in
model.safetensors (nothing there bounds them) but built at load time, max_positions x
hidden_size each."""
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
"""safetensors dtypes a weight of the model may be stored in."""
MAX_META_BYTES = 1 << 20
"""Largest ``export.json`` read (a few hundred bytes: the format, the step and the hashes)."""
_LAYER_NAME = re.compile(r"^(encoder_layers|decoder_layers)\.(\d+)\.(.+)$")


class ExportError(UserError, ValueError):
    """A missing, corrupt or inconsistent export directory: the message names the file."""


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------


def export_state_dict(model: EncoderDecoder) -> dict[str, torch.Tensor]:
    """The model's tensors, each stored once (tied tensors keep their first name), contiguous
    and detached on CPU: what ``model.safetensors`` holds."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().to("cpu").contiguous().clone()
    return out


def _residual_alpha(model: EncoderDecoder) -> float | dict[str, float]:
    """The factor that was folded: BranchNorm's alpha_t, DeepNorm's (encoder, decoder) alphas."""
    scheme = scheme_of(model.cfg)
    if scheme.step_scaled:
        return branch_scale_at(model.cfg, model.step)
    if scheme.deepnet_alpha:
        consts = residual_constants(scheme, model.cfg.encoder_layers, model.cfg.decoder_layers)
        return {"encoder": consts["encoder"][0], "decoder": consts["decoder"][0]}
    return 1.0


def is_legacy_export(path: str | Path) -> bool:
    """Whether ``path`` is an export written before output directories carried a marker
    (its export.json has our ``format``): ``--overwrite`` may replace it."""
    return json_has_format(Path(path) / META, EXPORT_FORMAT, 1 << 20)


def prepare_export_dir(
    out_dir: str | Path,
    overwrite: bool,
    output_flag: str = "--output",
    inputs: Sequence[tuple[str, str | Path | None]] = (),
) -> bool:
    """Check an export directory before anything is written (:func:`cli.prepare_output`):
    it must not overlap an input and must be absent, empty, or (with ``overwrite``) an export
    this project wrote (marker, or an older export's export.json). Returns whether an existing
    directory will be replaced. Raises :class:`ExportError`."""
    try:
        return prepare_output(
            out_dir, EXPORT_KIND, overwrite, output_flag, inputs, legacy=is_legacy_export
        )
    except OutputError as exc:
        raise ExportError(str(exc)) from None


def write_failure(exc: BaseException, out_dir: Path, what: str) -> ExportError:
    """An ExportError naming ``out_dir`` (not the temporary directory) for a failed write."""
    return ExportError(f"{out_dir}: cannot write the {what}: {write_failure_reason(exc)}")


def save_export(
    model: EncoderDecoder,
    out_dir: str | Path,
    spm_model_path: str | Path | None = None,
    meta: dict[str, Any] | None = None,
    overwrite: bool = False,
    output_flag: str = "--output",
) -> Path:
    """Write ``model`` (folded to Post-LN unless it is Pre-LN) as an export directory.

    ``meta`` adds provenance to ``export.json`` (e.g. ``source_checkpoint``, ``languages``,
    ``tag``, ``averaged``); ``step``, ``alpha``, ``scheme`` and ``residual`` are filled in from
    the model. Everything is written to a temporary directory beside ``out_dir`` (with the
    marker :data:`outputs.MARKER`) that is renamed at the end. An existing non-empty ``out_dir`` is
    an error unless ``overwrite``, and even then unless it is an export this project wrote; an
    ``out_dir`` that is, contains or lies inside the SentencePiece model is refused.
    """
    out_dir = Path(out_dir)
    inputs = [("the SentencePiece model", spm_model_path)] if spm_model_path else []
    prepare_export_dir(out_dir, overwrite, output_flag, inputs)
    if spm_model_path is not None and not Path(spm_model_path).is_file():
        raise ExportError(f"{spm_model_path}: SentencePiece model not found")
    scheme = scheme_of(model.cfg)
    alpha = _residual_alpha(model)
    exported = as_postln(model) if scheme.foldable_to_postln else model

    try:
        tmp = temp_dir_beside(out_dir, EXPORT_TOOL)
    except OSError as exc:
        raise write_failure(exc, out_dir, "export") from None
    try:
        save_file(export_state_dict(exported), str(tmp / WEIGHTS), metadata={"format": "pt"})
        model_dict = dataclasses.asdict(exported.cfg)
        (tmp / CONFIG).write_text(
            yaml.safe_dump({"model": model_dict}, sort_keys=False), encoding="utf-8"
        )
        files = [WEIGHTS, CONFIG]
        if spm_model_path is not None:
            shutil.copyfile(spm_model_path, tmp / SPM)
            files.append(SPM)
        info: dict[str, Any] = {"format": EXPORT_FORMAT, "version": EXPORT_VERSION}
        info.update(meta or {})
        info.update(
            {
                "step": int(model.step),
                "alpha": alpha,
                "scheme": scheme.name,
                "residual": exported.cfg.residual,
                "sha256": {name: sha256_file(tmp / name) for name in files},
            }
        )
        with open(tmp / META, "w", encoding="utf-8") as f:
            json.dump(info, f, indent=2, ensure_ascii=False, sort_keys=False)
            f.write("\n")
        write_marker(tmp, EXPORT_TOOL, EXPORT_KIND)
        prepare_export_dir(out_dir, overwrite, output_flag, inputs)  # still ours to replace
        publish_dir(tmp, out_dir)
    except (OSError, SafetensorError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failure(exc, out_dir, "export") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def model_config_from_dict(data: Any, where: str) -> ModelConfig:
    """A validated ModelConfig from the ``model`` mapping of ``config.yaml``; errors name the
    file and the key."""
    try:
        return parse_model_config(data)
    except ConfigError as exc:
        raise ExportError(f"{where}: {one_line(str(exc), 500)}") from None


def _read_meta(export_dir: Path) -> dict[str, Any]:
    path = export_dir / META
    meta = read_json_object(
        path, ExportError, "missing (not an export directory?)", max_bytes=MAX_META_BYTES
    )
    if meta.get("format") != EXPORT_FORMAT:
        raise ExportError(f"{path}: not a {EXPORT_FORMAT} file")
    if meta.get("version") != EXPORT_VERSION:
        raise ExportError(f"{path}: unsupported export version {quote(meta.get('version'))}")
    sums = meta.get("sha256", {})
    if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
        raise ExportError(
            f"{path}: key sha256 must be an object of file name: hex digest, got {quote(sums)}"
        )
    return meta


def _listed_files(export_dir: Path, meta: dict[str, Any]) -> dict[Path, str]:
    """{file: its recorded sha256} of export.json's ``sha256``, each name a regular file
    inside ``export_dir`` (:func:`file_inside`): a name never makes us stat or hash another
    file of the machine."""
    where = export_dir / META
    return {
        file_inside(export_dir, name, where, "sha256", ExportError): expected
        for name, expected in meta.get("sha256", {}).items()
    }


def _own_file(export_dir: Path, name: str, must_exist: bool = True) -> Path:
    """``export_dir/name`` (a fixed name of the export): a regular file, not a link out."""
    return file_inside(export_dir, name, export_dir, None, ExportError, must_exist)


def read_export_config(export_dir: str | Path) -> ModelConfig:
    """The ModelConfig stored in ``export_dir/config.yaml``."""
    path = _own_file(Path(export_dir), CONFIG)
    try:  # a regular file, read bounded (UTF-8: at most 4 bytes a character of the limit)
        text = read_small_file(path, 4 * YAML_MAX_BYTES).decode("utf-8")
        data = load_bounded(text, str(path))
    except FileShapeError as exc:
        raise ExportError(one_line(str(exc), 500)) from None
    except YAMLLimitError as exc:
        raise ExportError(one_line(str(exc), 500)) from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ExportError(f"{path}: cannot read ({one_line(str(exc), 300)})") from None
    if not isinstance(data, dict) or set(data) != {"model"}:
        raise ExportError(f"{path}: expected exactly one section 'model'")
    return model_config_from_dict(data["model"], str(path))


def _verify_checksums(export_dir: Path, meta: dict[str, Any]) -> None:
    for path, expected in _listed_files(export_dir, meta).items():
        if sha256_file(path) != expected:
            raise ExportError(f"{path}: checksum mismatch (corrupt or modified file)")


def read_weights_header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (shape, safetensors dtype)} from the header of a safetensors file; no
    tensor is read. Raises ExportError naming ``path``."""
    try:
        with safe_open(str(path), framework="pt") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}
            return {n: (tuple(s.get_shape()), s.get_dtype()) for n, s in slices.items()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        msg = one_line(str(exc), 300)
        raise ExportError(f"{path}: not a readable safetensors file ({msg})") from None


def _held_sizes(header: dict[str, tuple[tuple[int, ...], str]], weights: Path) -> dict[str, int]:
    """The config keys the tensors of ``header`` determine, with the values they imply."""
    emb = header.get("embedding.weight")
    if emb is None or len(emb[0]) != 2:
        raise ExportError(f"{weights}: no 2-D tensor embedding.weight (not an export of our model)")
    layers: dict[str, set[int]] = {"encoder_layers": set(), "decoder_layers": set()}
    for name in header:
        match = _LAYER_NAME.match(name)
        if match:
            layers[match[1]].add(int(match[2]))
    held = {"vocab_size": emb[0][0], "hidden_size": emb[0][1]}
    held.update({stack: len(indices) for stack, indices in layers.items()})
    fc1 = header.get("encoder_layers.0.ffn.fc1.weight")
    if fc1 is not None and len(fc1[0]) == 2:
        held["ffn_hidden_size"] = fc1[0][0]
    return held


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{name: shape} of every tensor an export of ``cfg`` holds. Built on the meta device from
    a one-layer model (layers of a stack share their shapes): allocates nothing, and costs the
    same whatever the depth."""
    one = dataclasses.replace(
        cfg, encoder_layers=1, decoder_layers=1, layernorm_impl="torch", compile=False
    )
    with torch.device("meta"):
        template = build_model(one, seed=0).state_dict()
    out: dict[str, tuple[int, ...]] = {}
    for name, tensor in template.items():
        match = _LAYER_NAME.match(name)
        if match is None:
            out[name] = tuple(tensor.shape)
            continue
        for i in range(getattr(cfg, match[1])):
            out[f"{match[1]}.{i}.{match[3]}"] = tuple(tensor.shape)
    return out


def check_config_against_weights(
    cfg: ModelConfig,
    header: dict[str, tuple[tuple[int, ...], str]],
    config_path: Path,
    weights: Path,
) -> None:
    """Raise ExportError (one line naming the key of ``config_path`` or the tensor of
    ``weights``) unless ``cfg`` is within bounds and describes exactly the tensors of the
    safetensors ``header``: names, shapes, floating-point dtypes. Runs before the model is
    built, so a config that disagrees with its weights never allocates anything."""
    if cfg.max_positions > MAX_EXPORT_POSITIONS:
        raise ExportError(
            f"{config_path}: key model.max_positions is {cfg.max_positions}, more than the "
            f"{MAX_EXPORT_POSITIONS} an export may declare"
        )
    for key, held in _held_sizes(header, weights).items():
        if getattr(cfg, key) != held:
            raise ExportError(
                f"{config_path}: key model.{key} is {getattr(cfg, key)}, but the tensors of "
                f"{weights} imply {held}"
            )
    expected = _expected_shapes(cfg)
    missing = sorted(set(expected) - set(header))
    unexpected = sorted(set(header) - set(expected))
    if missing or unexpected:
        what = [f"missing {missing[:3]}"] if missing else []
        what += [f"unexpected {unexpected[:3]}"] if unexpected else []
        raise ExportError(f"{weights}: tensors do not match {config_path} ({', '.join(what)})")
    for name, (shape, dtype) in header.items():
        if shape != expected[name]:
            raise ExportError(
                f"{weights}: tensor {name} has shape {shape}, {config_path} implies "
                f"{expected[name]}"
            )
        if dtype not in FLOAT_DTYPES:
            raise ExportError(
                f"{weights}: tensor {name} has dtype {dtype} (expected one of "
                f"{', '.join(FLOAT_DTYPES)})"
            )


def load_export(
    export_dir: str | Path, device: str | torch.device = "cpu", verify: bool = True
) -> tuple[EncoderDecoder, Any, dict[str, Any]]:
    """(model in eval mode, SentencePieceProcessor or None, export.json contents).

    Reads safetensors, YAML and JSON only. ``verify`` checks the sha256 sums of export.json.
    config.yaml is checked against the safetensors header (:func:`check_config_against_weights`)
    before the model is built. Raises ExportError naming the missing or corrupt file.
    """
    export_dir = Path(export_dir)
    if not export_dir.is_dir():
        raise ExportError(f"{export_dir}: not a directory (an export directory is expected)")
    meta = _read_meta(export_dir)
    cfg = read_export_config(export_dir)
    weights = _own_file(export_dir, WEIGHTS)
    if verify:
        _verify_checksums(export_dir, meta)
    check_config_against_weights(cfg, read_weights_header(weights), export_dir / CONFIG, weights)
    try:
        state = load_file(str(weights), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        msg = " ".join(str(exc).split())
        raise ExportError(f"{weights}: not a readable safetensors file ({msg})") from None
    model = build_model(cfg, seed=0)
    model.load_state_dict(state, strict=True)
    if scheme_of(cfg).step_scaled:
        model.set_step(int(meta.get("step", 1)))
    model.to(device).eval()
    return model, _load_spm(export_dir, meta), meta


def _load_spm(export_dir: Path, meta: dict[str, Any]) -> Any:
    path = _own_file(export_dir, SPM, must_exist=SPM in meta.get("sha256", {}))
    if not path.exists():
        return None
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor()
    try:
        processor.Load(str(path))
    except (OSError, RuntimeError) as exc:
        msg = " ".join(str(exc).split())
        raise ExportError(f"{path}: not a readable SentencePiece model ({msg})") from None
    return processor


# --------------------------------------------------------------------------------------------
# Checkpoint averaging
# --------------------------------------------------------------------------------------------


def average_state_dicts(states: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The element-wise mean of state dicts with equal keys and shapes (``--average-last K``).

    Floating-point tensors are summed in float64 and cast back to their dtype; other tensors
    (counters, masks) must be equal across the inputs and are kept.
    """
    if not states:
        raise ValueError("average_state_dicts: no state dicts given")
    first = states[0]
    for i, sd in enumerate(states[1:], start=1):
        if set(sd) != set(first):
            diff = sorted(set(sd) ^ set(first))
            raise ValueError(f"average_state_dicts: state dict {i} has different keys {diff[:3]}")
    out: dict[str, torch.Tensor] = {}
    n = len(states)
    for name, ref in first.items():
        tensors = [sd[name] for sd in states]
        for i, t in enumerate(tensors):
            if t.shape != ref.shape:
                raise ValueError(
                    f"average_state_dicts: {name} has shape {tuple(t.shape)} in state dict {i}, "
                    f"{tuple(ref.shape)} in state dict 0"
                )
        if ref.is_floating_point():
            acc = torch.zeros(ref.shape, dtype=torch.float64)
            for t in tensors:
                acc += t.detach().to("cpu", torch.float64)
            out[name] = (acc / n).to(ref.dtype)
        else:
            if any(not torch.equal(t, ref) for t in tensors):
                raise ValueError(f"average_state_dicts: non-float tensor {name} differs")
            out[name] = ref.detach().clone()
    return out
