"""`prewarm manifest`: a KDA serving manifest from what a deployment already states, the model's ``config.json`` and
the server's launch arguments (sglang's own precompile tool, compile_deep_gemm, takes launch_server's arguments for
the same reason).

Beside every value the written manifest names its source: a config field (``config.json:
text_config.linear_attn_config.num_heads``), a launch flag (``--tp-size 8``) or the server's default, with the
version whose source it was read from. The servers' defaults below are theirs, not guesses:

- sglang 0.5.23 (``sglang/srt/arg_groups``): decode CUDA-graph batch sizes ``generate_decode_cuda_graph_batch_sizes``
  up to a max batch size that ``memory_hook`` picks from the device's memory and the TP size (capped by
  ``--max-running-requests`` when defaulted), the chunked-prefill size from the same table, DSPARK's
  ``max_running_requests`` 48; attention-TP = tp / attention-DP (``derive_attn_tp_size``); without a decode graph
  (``--disable-cuda-graph``, ``--disable-decode-cuda-graph``, ``--cuda-graph-backend-decode disabled``, or
  ``--cuda-graph-config``'s decode object, which wins over the flags: ``_parse_cuda_graph_config``) decode batches
  of every size up to ``--max-running-requests``.
- vLLM 0.34.0 (``vllm/config/vllm.py`` ``VllmConfig._set_cudagraph_sizes``, ``vllm/engine/arg_utils.py``
  ``EngineArgs.get_batch_defaults``, ``vllm/utils/argparse_utils.py``): capture sizes (tokens) ``[1, 2, 4] +
  range(8, 256, 8) + range(256, top + 1, 16)`` (``--performance-mode interactivity``: every size up to 32 first) with
  top = min(max_num_seqs * (1 + speculative tokens) * 2, 1024 on sm_10x else 512, max_num_batched_tokens), plus
  max_num_batched_tokens and the uniform decode sizes (requests x (1 + speculative tokens)) that fit; the `vllm
  serve` defaults max_num_seqs / max_num_batched_tokens 1024 / 16384 on a device of 160 GiB or more, 1024 / 8192 on
  70 GiB or more that is not an A100, else 256 / 2048, both doubled by ``--performance-mode throughput``; no CUDA
  graphs with ``--enforce-eager``, ``-O0`` or ``cudagraph_mode`` NONE (decode batches of every size then). Its
  spellings: ``--a_b`` for ``--a-b``, ``-O3``, dotted ``-cc.key value`` / ``--speculative-config.key=value``.

An argument that does not change the envelope (or that this table does not know) is ignored and listed; a value the
manifest needs and no flag, field or default gives is a ManifestError naming the flag or field to add.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from .errors import EnvironmentProblem, ManifestError

SERVERS = ("sglang", "vllm")
KERNELS = {"own": "prewarm_kernels.kda.serving", "fla": "prewarm.providers.fla_kda",
           "sglang": "prewarm.providers.sglang.cuda", "vllm": "prewarm.providers.vllm_kda"}  # fmt: skip
DEFAULT_KERNELS = {"vllm": "vllm"}  # --kernels when not given: the server's own KDA kernels (sglang: say which)
SGLANG_PROVIDERS = {"cuda": "prewarm.providers.sglang.cuda", "npu": "prewarm.providers.sglang.ascend"}  # by backend
SGLANG = "sglang 0.5.23"
VLLM = "vLLM 0.34.0"
_DTYPE_NAMES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32",
                "float": "float32"}  # fmt: skip
_MIB, _GIB = 1 << 20, 1 << 30

# sglang 0.5.23 memory_hook: (device memory below, MiB) -> (chunked_prefill_size, decode max_bs tp < 4, tp >= 4)
_SGLANG_BY_MEMORY = ((20 * 1024, 2048, 8, 8), (35 * 1024, 4096, 48, 160), (60 * 1024, 4096, 32, 160),
                     (90 * 1024, 8192, 256, 512), (160 * 1024, 8192, 256, 512), (math.inf, 16384, 512, 512))
SGLANG_MAX_PREFILL_TOKENS = 16384  # --max-prefill-tokens' default: the budget when chunked prefill is off (-1)
SGLANG_DSPARK_MAX_RUNNING = 48  # _handle_dspark: max_running_requests when not given


@dataclass(frozen=True)
class Sourced:
    """One manifest value and where it came from."""

    value: Any
    source: str


@dataclass(frozen=True)
class GeneratedManifest:
    name: str
    target: dict[str, str | None]  # backend, arch, device
    kernels: str  # own | fla | sglang | vllm
    spec: dict[str, dict[str, Sourced]]  # [spec.<table>] -> key -> value
    notes: tuple[str, ...]  # what was left to the provider, and why
    ignored: tuple[str, ...]  # launch arguments that change nothing here (or that this table does not know)
    config: str  # the config.json read
    server: str
    server_args: tuple[str, ...]

    @property
    def provider(self) -> str:
        return SGLANG_PROVIDERS[self.target["backend"]] if self.kernels == "sglang" else KERNELS[self.kernels]

    def spec_table(self) -> dict[str, dict[str, Any]]:
        return {table: {k: v.value for k, v in keys.items()} for table, keys in self.spec.items()}

    def toml(self) -> str:
        """The manifest: every value with its source as a comment."""
        header = [f"Generated by `prewarm manifest` for a {self.server} server running KDA through --kernels "
                  f"{self.kernels}.", f"Model config: {self.config}",
                  f"Launch arguments: {' '.join(self.server_args) or '(none)'}"]
        if self.ignored:
            header.append(f"Ignored (not part of the KDA kernels' envelope): {'; '.join(self.ignored)}")
        lines = [f"# {line}" for text in [*header, *self.notes]
                 for line in textwrap.wrap(_comment(text), 116, subsequent_indent="  ", break_on_hyphens=False)]
        lines += ["", f"name = {_toml(self.name)}", "", "[target]"]
        target = ":".join(v for v in self.target.values() if v is not None)
        lines += _rows([(k, Sourced(v, f"--target {target}")) for k, v in self.target.items() if v is not None])
        for table, keys in self.spec.items():
            lines += ["", f"[spec.{table}]", *_rows(list(keys.items()))]
        lines += ["", "[[kernels]]", *_rows([("provider", Sourced(self.provider, f"--kernels {self.kernels}"))])]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict:
        return {"name": self.name, "target": self.target, "provider": self.provider, "server": self.server,
                "config": self.config, "server_args": list(self.server_args), "ignored": list(self.ignored),
                "notes": list(self.notes),
                "spec": {t: {k: {"value": v.value, "source": v.source} for k, v in keys.items()}
                         for t, keys in self.spec.items()}}  # fmt: skip


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: the same escapes
    return "[" + ", ".join(_toml(v) for v in value) + "]"


def _rows(items: list[tuple[str, Sourced]], wide: int = 48) -> list[str]:
    """``key = value  # source``, the sources aligned; a value too wide for that has its source on the line above."""
    cells = [f"{k} = {_toml(v.value)}" for k, v in items]
    width = max((len(c) for c in cells if len(c) <= wide), default=0)
    return [f"# {_comment(v.source)}\n{c}" if len(c) > wide else f"{c:<{width}}  # {_comment(v.source)}"
            for c, (_, v) in zip(cells, items)]


def _comment(text: str) -> str:
    """Text safe inside a TOML comment: a launch argument's control characters cannot end it."""
    return re.sub(r"[\x00-\x1f\x7f]", " ", text)


# --- the model's config ---------------------------------------------------------------------------------------------


def read_model_config(model: str | Path) -> tuple[dict, str, Path, dict]:
    """(the text model's config, the dotted prefix its fields are named under, the file, the whole config) from a
    model dir or its config.json. A multimodal config (Kimi K3) nests the text model under ``text_config``."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise ManifestError(f"{path}: cannot read the model config: {e.strerror} (expected a model dir holding "
                            "config.json, or the config.json itself)") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path}: not a JSON model config: {e}") from e
    if not isinstance(doc, dict):
        raise ManifestError(f"{path}: expected a JSON object, found {type(doc).__name__}")
    if isinstance(doc.get("text_config"), dict):
        return doc["text_config"], "text_config.", path, doc
    return doc, "", path, doc


class _Config:
    """Typed reads of the text model's config; an absent or bad field is an error naming it and the file."""

    def __init__(self, doc: dict, prefix: str, path: Path, top: dict):
        self.doc, self.prefix, self.path, self.top = doc, prefix, path, top

    def source(self, field: str) -> str:
        return f"config.json: {self.prefix}{field}"

    def linear(self, key: str, check, expected: str, required: bool = True) -> Any:
        la = self.doc.get("linear_attn_config")
        field = f"{self.prefix}linear_attn_config"
        if not isinstance(la, dict):
            raise ManifestError(f"{self.path}: {field} is {'missing' if la is None else repr(la)}: expected the "
                                "KDA layers' table (KimiLinearConfig: num_heads, head_dim, kda_layers, ...)")
        if key not in la and not required:
            return None
        value = la.get(key)
        if key not in la or not check(value):
            what = "is missing" if key not in la else f"= {value!r}"
            raise ManifestError(f"{self.path}: {field}.{key} {what}: expected {expected}")
        return value

    def dtype(self) -> tuple[str, str] | None:
        """(dtype name, its field) from ``torch_dtype`` or ``dtype`` (transformers >= 4.56 writes the latter), the
        text model's first, then the top level's."""
        for doc, prefix in ((self.doc, self.prefix), (self.top, "")):
            for key in ("torch_dtype", "dtype"):
                if isinstance(doc.get(key), str):
                    return doc[key], f"config.json: {prefix}{key}"
        return None


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


# --- the launch arguments -------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse for a server's launch flags: a bad value is a ManifestError naming the flag, not an exit."""

    def error(self, message: str):
        raise ManifestError(f"{self.prog}: {message}")


def _ints(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(text)
    return value


def _json_object(text: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(text)
    return value


def _parser(server: str) -> _Parser:
    """The flags that fix the KDA kernels' envelope, as each server spells them (every spelling it accepts)."""
    p = _Parser(prog=f"prewarm manifest --server {server}", add_help=False, allow_abbrev=False)
    if server == "sglang":
        p.add_argument("--tp-size", "--tensor-parallel-size", type=_ints)
        p.add_argument("--dp-size", "--data-parallel-size", type=_ints)
        p.add_argument("--enable-dp-attention", action="store_true")
        p.add_argument("--attn-dp-size", "--attention-data-parallel-size", type=_ints)
        p.add_argument("--attn-cp-size", "--attention-context-parallel-size", type=_ints)
        p.add_argument("--cuda-graph-bs", "--cuda-graph-bs-decode", type=_ints, nargs="+")
        p.add_argument("--cuda-graph-max-bs", "--cuda-graph-max-bs-decode", type=_ints)
        p.add_argument("--disable-cuda-graph-padding", action="store_true")
        p.add_argument("--disable-cuda-graph", action="store_true")
        p.add_argument("--disable-decode-cuda-graph", action="store_true")
        p.add_argument("--cuda-graph-backend-decode", choices=("full", "breakable", "disabled"))
        p.add_argument("--cuda-graph-config", type=_json_object)
        p.add_argument("--max-running-requests", type=_ints)
        p.add_argument("--speculative-algorithm")
        p.add_argument("--speculative-num-draft-tokens", type=_ints)
        p.add_argument("--speculative-dspark-block-size", type=_ints)
        p.add_argument("--chunked-prefill-size", type=int)
        p.add_argument("--max-prefill-tokens", type=_ints)
        p.add_argument("--max-mamba-cache-size", type=_ints)
        p.add_argument("--disable-radix-cache", action="store_true")
        p.add_argument("--sampling-backend")
    else:
        p.add_argument("--tensor-parallel-size", "-tp", type=_ints)
        p.add_argument("--max-num-seqs", type=_ints)
        p.add_argument("--max-num-batched-tokens", type=_ints)
        p.add_argument("--cudagraph-capture-sizes", type=_ints, nargs="+")
        p.add_argument("--max-cudagraph-capture-size", type=_ints)
        p.add_argument("--compilation-config", "-cc", type=_json_object)
        p.add_argument("--speculative-config", type=_json_object)
        p.add_argument("--performance-mode", choices=("balanced", "interactivity", "throughput"))
        p.add_argument("--optimization-level", choices=("0", "1", "2", "3"))
        p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--dtype", choices=("auto", *_DTYPE_NAMES))
    return p


_NUMBER = re.compile(r"-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?")


def _vllm_argv(argv: list[str]) -> list[str]:
    """A vLLM launch line in the spelling ``_parser`` reads, as vLLM's FlexibleArgumentParser rewrites it first:
    ``--a_b`` is ``--a-b``; ``-O3`` / ``-O=3`` / ``-O 3`` is ``--optimization-level 3``; dotted keys of a JSON flag
    (``-cc.cudagraph_mode=NONE``, ``--speculative-config.num_speculative_tokens 3``, ``key+ a,b`` for a list) are
    merged into that flag's object."""
    if "--cuda-graph-sizes" in (w.split("=", 1)[0] for w in argv):
        raise ManifestError(f"--cuda-graph-sizes: not a {VLLM} flag (vLLM renamed it --cudagraph-capture-sizes): "
                            "use that spelling")
    out: list[str] = []
    dotted: dict[str, dict] = {}
    i = 0
    while i < len(argv):
        word = argv[i]
        i += 1
        if word.startswith("--"):
            key, eq, value = word.partition("=")
            head, dot, tail = key[2:].partition(".")
            word = "--" + head.replace("_", "-") + dot + tail + eq + value
        if re.fullmatch(r"-O=?[0-3]", word):
            out += ["--optimization-level", word[-1]]
            continue
        if word == "-O" and i < len(argv) and argv[i] in ("0", "1", "2", "3"):
            word = "--optimization-level"
        key, eq, value = word.partition("=")
        if word.startswith("-") and "." in key and not _NUMBER.fullmatch(word):  # (a negative value is no flag)
            if not eq:
                if i >= len(argv):
                    raise ManifestError(f"{word}: no value follows it")
                value, i = argv[i], i + 1
            flag, *path = key.rstrip("+").split(".")
            flag = "--compilation-config" if flag == "-cc" else flag
            try:
                parsed = json.dumps(value.split(",")) if key.endswith("+") else value
                parsed = json.loads(parsed)
            except json.JSONDecodeError:
                parsed = value
            node = dotted.setdefault(flag, {})
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = parsed
            continue
        out.append(word)
    for flag, doc in dotted.items():
        given = next((j for j, w in enumerate(out) if w.split("=", 1)[0] == flag), None)
        if given is None:
            out += [flag, json.dumps(doc)]
            continue
        whole = out[given].partition("=")[2] if "=" in out[given] else out[given + 1]
        try:
            base = json.loads(whole)
        except json.JSONDecodeError:
            base = None
        if not isinstance(base, dict):
            raise ManifestError(f"{flag} {whole}: not a JSON object")
        base.update(doc)
        out[given:given + (1 if "=" in out[given] else 2)] = [flag, json.dumps(base)]
    return out


def _flag(argv: list[str], *names: str, many: bool = False) -> str:
    """The flag as the launch line spelled it, with its value(s) (``--cuda-graph-bs 11 16``), for a source comment:
    one value, or (``many``) every word up to the next flag."""
    for i, word in enumerate(argv):
        if word.split("=", 1)[0] not in names:
            continue
        if "=" in word:
            return word
        values = []
        for w in argv[i + 1:]:
            if w.startswith("-") and not re.fullmatch(r"-\d+", w):
                break
            values.append(w)
            if not many:
                break
        return " ".join([word, *values])
    return names[0]


# --- the mapping ----------------------------------------------------------------------------------------------------


def generate(model: str | Path, server: str, kernels: str | None, target: str, server_args: list[str],
             name: str | None = None) -> GeneratedManifest:
    """The manifest for a model config and a launch line (see the module docstring); nothing is written."""
    if server not in SERVERS:
        raise ManifestError(f"--server {server!r}: expected one of {', '.join(SERVERS)}")
    kernels = kernels or DEFAULT_KERNELS.get(server)
    if kernels is None:
        raise ManifestError(f"--kernels: required with --server {server} (one of {', '.join(KERNELS)})")
    if kernels not in KERNELS:
        raise ManifestError(f"--kernels {kernels!r}: expected one of {', '.join(KERNELS)}")
    if kernels in SERVERS and kernels != server:
        raise ManifestError(f"--kernels {kernels} with --server {server}: {kernels}'s own KDA kernels run only in "
                            f"{kernels}")
    backend, arch, device, profile = _target(target)
    cfg = _Config(*read_model_config(model))
    argv = _vllm_argv(list(server_args)) if server == "vllm" else list(server_args)
    args, unknown = _parser(server).parse_known_args(argv)
    ignored = []  # each unknown flag with the values after it, as the launch line has them
    for word in unknown:
        if word.startswith("-") and not _NUMBER.fullmatch(word) or not ignored:
            ignored.append(word)
        else:
            ignored[-1] += f" {word}"

    parallel = (_sglang_parallel if server == "sglang" else _vllm_parallel)(args, argv)
    tp, dp = parallel["tensor_parallel"].value, parallel["attention_dp"].value
    heads = cfg.linear("num_heads", _positive_int, "a positive integer (KDA heads, all ranks)")
    head_dim = cfg.linear("head_dim", _positive_int, "a positive integer (the KDA head dim)")
    kda_layers = cfg.linear("kda_layers", lambda v: isinstance(v, list) and v and all(map(_positive_int, v)),
                            "a non-empty list of layer numbers (the KDA layers)")
    lower = cfg.linear("gate_lower_bound", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
                       "a number (the KDA gate's lower bound)", required=False)
    per_rank = f"; attention-TP {tp // dp}, {heads // (tp // dp)} per rank" if tp % dp == 0 and tp >= dp and \
        heads % (tp // dp) == 0 else ""  # otherwise read_kda says what does not divide
    model_t = {"kda_heads": Sourced(heads, f"{cfg.source('linear_attn_config.num_heads')} (all ranks{per_rank})"),
               "head_k_dim": Sourced(head_dim, cfg.source("linear_attn_config.head_dim")),
               "head_v_dim": Sourced(head_dim, cfg.source("linear_attn_config.head_dim") + " (K and V alike)"),
               "layers": Sourced(len(kda_layers), f"len({cfg.source('linear_attn_config.kda_layers')})")}
    if lower is not None:
        model_t["gate_lower_bound"] = Sourced(float(lower), cfg.source("linear_attn_config.gate_lower_bound"))

    activation = _activation(args, argv, cfg)
    gate = [activation.value, "float32"] if activation.value != "float32" else ["float32"]
    dtypes = {"activation": activation,
              "gate": Sourced(gate, "the raw gate in the activation dtype, or kept in fp32: both planned")}
    serving, mrr, notes = _sglang_serving(args, argv, profile) if server == "sglang" else \
        _vllm_serving(args, argv, profile, arch)
    if mrr is not None:
        if kernels in ("sglang", "vllm"):  # the providers that plan every eager decode batch size read it
            serving["max_running_requests"] = mrr
        else:
            notes.append(f"max running requests {mrr.value} ({mrr.source}): not written, --kernels {kernels}'s "
                         "provider does not read it")
    spec = {"model": model_t, "parallel": parallel, "dtypes": dtypes, "serving": serving}
    if kernels == "vllm":
        notes.append("state slot stride: not written (vLLM lays each state slot out as one page with the conv state, "
                     "padded to the attention page, by its KV-cache planning at startup): the provider plans a dense "
                     "pool; add [spec.vllm] state_slot_strides = [layer.kv_cache[1].stride(0)] as the node has it "
                     "(see manifests/kimi-linear-h200-vllm.toml)")
    if server == "sglang" and kernels == "sglang" and backend == "npu":
        spec["sglang"] = _sglang_ascend(args, argv, cfg, serving)
    if server == "sglang" and kernels == "sglang" and backend == "cuda":
        spec["sglang"] = _sglang_cuda(args)
    gen = GeneratedManifest(name or _name(cfg.path, server), {"backend": backend, "arch": arch, "device": device},
                            kernels, spec, tuple(notes), tuple(ignored), str(cfg.path), server, tuple(argv))
    _check(gen)
    return gen


def _target(text: str):
    """BACKEND:ARCH[:DEVICE] -> (backend, arch, device, its profile or None), checked as a manifest's [target]."""
    from . import devices
    from .manifest import BACKENDS

    parts = text.split(":")
    if len(parts) not in (2, 3) or not all(parts):
        raise ManifestError(f"--target {text!r}: expected BACKEND:ARCH[:DEVICE], e.g. cuda:sm_90:H200 or "
                            "npu:Ascend910_9391")
    backend, arch, device = parts[0], parts[1], parts[2] if len(parts) == 3 else None
    if backend not in BACKENDS:
        raise ManifestError(f"--target {text!r}: backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if device is None:
        return backend, arch, None, None
    from .plan import manifest_device  # imports torch's planning side: only where a device is named

    manifest_device(SimpleNamespace(path=f"--target {text}", device=device, backend=backend, arch=arch))
    return backend, arch, device, devices.lookup(device, f"--target {text}")


def _name(config: Path, server: str) -> str:
    stem = config.resolve().parent.name or "model"
    return re.sub(r"[^a-z0-9.]+", "-", stem.lower()).strip("-") + f"-{server}"


def _activation(args, argv: list[str], cfg: _Config) -> Sourced:
    """``--dtype`` or the config's dtype; ``auto`` (both servers): FP16 for FP32 and FP16 models, BF16 for BF16."""
    if args.dtype not in (None, "auto"):
        return Sourced(_DTYPE_NAMES[args.dtype], _flag(argv, "--dtype"))
    found = cfg.dtype()
    if found is None or found[0] not in _DTYPE_NAMES:
        raise ManifestError(f"{cfg.path}: no activation dtype: the config has no torch_dtype / dtype "
                            f"({found[0] if found else 'absent'}): add --dtype bfloat16|float16|float32 to the "
                            "launch arguments")
    value, field = _DTYPE_NAMES[found[0]], found[1]
    how = "--dtype auto" if args.dtype == "auto" else "no --dtype: auto"
    if value == "float32":
        return Sourced("float16", f"{field} = float32, {how}: FP16 for FP32 models")
    return Sourced(value, f"{field} ({how})")


def _sglang_parallel(args, argv: list[str]) -> dict[str, Sourced]:
    if args.attn_cp_size and args.attn_cp_size > 1:
        raise ManifestError(f"{_flag(argv, '--attn-cp-size', '--attention-context-parallel-size')}: attention "
                            "context parallelism splits the KDA heads another way than [spec.parallel] describes "
                            "(attention-TP = tensor_parallel / attention_dp): not supported")
    tp = Sourced(args.tp_size or 1, _flag(argv, "--tp-size", "--tensor-parallel-size") if args.tp_size
                 else f"{SGLANG}'s default (no --tp-size)")
    if args.attn_dp_size:
        dp = Sourced(args.attn_dp_size, _flag(argv, "--attn-dp-size", "--attention-data-parallel-size"))
    elif args.enable_dp_attention:
        dp = Sourced(args.dp_size or 1, f"{_flag(argv, '--dp-size', '--data-parallel-size')} with "
                                        "--enable-dp-attention (sglang's deprecated spelling of --attn-dp-size)")
    else:
        why = "--dp-size without --enable-dp-attention: replicas" if args.dp_size else "no DP attention"
        dp = Sourced(1, f"{why} (attention-TP = the TP size)")
    return {"tensor_parallel": tp, "attention_dp": dp}


def _sglang_ascend(args, argv: list[str], cfg: _Config, serving: dict[str, Sourced]) -> dict[str, Sourced]:
    """``[spec.sglang]`` of sglang's Ascend KDA backend (prewarm.providers.sglang.ascend): the pools' geometry that
    reaches a constexpr, and the radix cache's state tracking."""
    out = {"track_state": Sourced(not args.disable_radix_cache, "--disable-radix-cache (no state tracking)"
                                  if args.disable_radix_cache else f"{SGLANG}'s radix cache (on by default) tracks "
                                  "KDA state in an extra buffer")}
    if args.max_mamba_cache_size:
        out["mamba_pool_slots"] = Sourced(args.max_mamba_cache_size + 1,
                                          f"{_flag(argv, '--max-mamba-cache-size')} + the pool's padding slot")
    elif "draft_widths" in serving:
        raise ManifestError("mamba pool slots: sglang's Ascend verify rolls the conv state back with the conv pool's "
                            "strides as constexprs, and sglang sizes that pool from the device's memory at startup: "
                            "add --max-mamba-cache-size N to the launch arguments")
    out["conv_kernel"] = Sourced(cfg.linear("short_conv_kernel_size", _positive_int, "a positive integer (the "
                                            "short conv's kernel)"), cfg.source("linear_attn_config."
                                                                                 "short_conv_kernel_size"))
    return out


def _vllm_parallel(args, argv: list[str]) -> dict[str, Sourced]:
    tp = Sourced(args.tensor_parallel_size or 1, _flag(argv, "--tensor-parallel-size", "-tp")
                 if args.tensor_parallel_size else f"{VLLM}'s default (no --tensor-parallel-size)")
    return {"tensor_parallel": tp,
            "attention_dp": Sourced(1, "vLLM: every data-parallel rank holds a whole TP group (attention-TP = TP)")}


def _sglang_cuda(args) -> dict[str, Sourced]:
    """``[spec.sglang]`` of sglang's CUDA KDA backend (prewarm.providers.sglang.cuda): the sampling backend, whose
    FlashInfer module the server JIT-builds at the first request with temperature > 0."""
    from .providers.sglang.common import SAMPLING_BACKENDS

    backend = args.sampling_backend or SAMPLING_BACKENDS[0]
    if backend not in SAMPLING_BACKENDS:
        raise ManifestError(f"--sampling-backend {backend}: the plan knows {', '.join(SAMPLING_BACKENDS)} "
                            f"(sglang's CUDA backends)")
    return {"sampling_backend": Sourced(backend, "--sampling-backend" if args.sampling_backend else
                                        f"{SGLANG}'s default where FlashInfer is installed")}


def _sglang_decode_sizes(max_bs: int, speculative: bool, no_padding: bool) -> list[int]:
    """sglang 0.5.23's generate_decode_cuda_graph_batch_sizes."""
    if no_padding:
        sizes = list(range(1, max_bs + 1))
    elif not speculative:
        sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, max_bs + 1, 32)]
    else:
        sizes = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 257, 8), *range(272, max_bs + 1, 16)]
    sizes = [s for s in sizes if s <= max_bs]
    return sizes if max_bs in sizes else [*sizes, max_bs]


def _memory(profile) -> int | None:
    return profile.total_memory if profile is not None and profile.total_memory else None


def _sglang_decode_graph(args, argv) -> SimpleNamespace:
    """sglang 0.5.23's decode CUDA-graph settings (``_parse_cuda_graph_config``): ``--cuda-graph-config``'s decode
    object wins over the per-phase flags, which win over the off-switches; each as (value, its source) or None."""
    given = (args.cuda_graph_config or {}).get("decode", {})
    if not isinstance(given, dict):
        raise ManifestError(f"--cuda-graph-config decode = {json.dumps(given)}: expected a JSON object")
    where = "--cuda-graph-config decode"
    backend, backend_source = None, None
    if "backend" in given:
        backend, backend_source = given["backend"], f"{where}.backend {json.dumps(given['backend'])}"
        if backend not in ("full", "breakable", "disabled"):
            raise ManifestError(f"{backend_source}: expected one of full, breakable, disabled")
    elif args.cuda_graph_backend_decode:
        backend, backend_source = args.cuda_graph_backend_decode, _flag(argv, "--cuda-graph-backend-decode")
    elif args.disable_decode_cuda_graph or args.disable_cuda_graph:
        backend = "disabled"
        backend_source = "--disable-decode-cuda-graph" if args.disable_decode_cuda_graph else "--disable-cuda-graph"
    bs = max_bs = None
    if "bs" in given:
        if not isinstance(given["bs"], list) or not given["bs"] or not all(map(_positive_int, given["bs"])):
            raise ManifestError(f"{where}.bs {json.dumps(given['bs'])}: expected a list of positive integers")
        bs = given["bs"], f"{where}.bs {json.dumps(given['bs'])}"
    elif args.cuda_graph_bs:
        bs = args.cuda_graph_bs, _flag(argv, "--cuda-graph-bs", "--cuda-graph-bs-decode", many=True)
    if "max_bs" in given:
        if not _positive_int(given["max_bs"]):
            raise ManifestError(f"{where}.max_bs {json.dumps(given['max_bs'])}: expected a positive integer")
        max_bs = given["max_bs"], f"{where}.max_bs {given['max_bs']}"
    elif args.cuda_graph_max_bs:
        max_bs = args.cuda_graph_max_bs, _flag(argv, "--cuda-graph-max-bs", "--cuda-graph-max-bs-decode")
    return SimpleNamespace(backend=backend, backend_source=backend_source, bs=bs, max_bs=max_bs)


def _sglang_serving(args, argv, profile):
    """Decode buckets, draft widths, the prefill budget (sglang's spelling and defaults), the running-request cap."""
    notes: list[str] = []
    serving: dict[str, Sourced] = {}
    memory = _memory(profile)
    by_memory = next(row for row in _SGLANG_BY_MEMORY if memory / _MIB < row[0]) if memory else None
    algo = (args.speculative_algorithm or "").upper() or None
    if args.max_running_requests:
        mrr = Sourced(args.max_running_requests, _flag(argv, "--max-running-requests"))
    elif algo == "DSPARK":
        mrr = Sourced(SGLANG_DSPARK_MAX_RUNNING, f"{SGLANG}'s default with --speculative-algorithm DSPARK")
    else:
        mrr = None

    decode = _sglang_decode_graph(args, argv)
    if decode.backend == "disabled":  # no decode graph: eager batches of every size up to the request cap
        if mrr is None:
            raise ManifestError(f"decode batch buckets: {decode.backend_source} runs decode batches of every size up to "
                                "the running-request cap, which sglang sizes from its KV pool at startup: add "
                                "--max-running-requests N to the launch arguments")
        serving["decode_batch_buckets"] = Sourced(list(range(1, mrr.value + 1)), (
            f"{decode.backend_source}: no decode CUDA graph, eager batches of every size up to {mrr.value} "
            f"({mrr.source})"))
    elif decode.bs:  # captured as given: the kernels run at each size at capture, whatever the request cap
        serving["decode_batch_buckets"] = Sourced(sorted(set(decode.bs[0])), decode.bs[1])
    else:
        tp = args.tp_size or 1
        if decode.max_bs:
            max_bs, how = decode.max_bs
        elif by_memory:
            max_bs = by_memory[2] if tp < 4 else by_memory[3]
            how = f"max {max_bs} for the {profile.name}'s memory at TP {tp}"
            if mrr is not None and max_bs > mrr.value:
                max_bs, how = mrr.value, f"max {mrr.value}, the running-request cap ({mrr.source})"
        else:
            raise ManifestError("decode batch buckets: sglang derives its CUDA-graph batch sizes from the device's "
                                "memory: add --cuda-graph-bs N ... (or --cuda-graph-max-bs N) to the launch "
                                "arguments, or name the device in --target BACKEND:ARCH:DEVICE")
        kind = "every size, --disable-cuda-graph-padding" if args.disable_cuda_graph_padding else (
            "speculative list" if algo else "plain list")
        serving["decode_batch_buckets"] = Sourced(
            _sglang_decode_sizes(max_bs, bool(algo), args.disable_cuda_graph_padding),
            f"{SGLANG}'s default CUDA-graph sizes ({kind}, {how})")

    if args.speculative_num_draft_tokens:
        serving["draft_widths"] = Sourced([args.speculative_num_draft_tokens],
                                          _flag(argv, "--speculative-num-draft-tokens"))
    elif algo == "DSPARK" and args.speculative_dspark_block_size:
        serving["draft_widths"] = Sourced([args.speculative_dspark_block_size + 1],
                                          f"{_flag(argv, '--speculative-dspark-block-size')} + 1 (DSPARK verifies "
                                          "gamma + 1 tokens)")
    elif algo:
        raise ManifestError(f"draft widths: --speculative-algorithm {args.speculative_algorithm} without "
                            "--speculative-num-draft-tokens: sglang then takes the verify width from the draft "
                            "checkpoint (DSPARK: its block size + 1, else gamma 7 + 1): add "
                            "--speculative-num-draft-tokens N to the launch arguments")
    else:
        notes.append("draft widths: none (no --speculative-algorithm: no speculative verify)")

    chunk = args.chunked_prefill_size
    if chunk is not None and chunk > 0:
        serving["max_prefill_tokens"] = Sourced(chunk, _flag(argv, "--chunked-prefill-size"))
    elif chunk is not None:  # -1: chunking off, one prefill batch up to --max-prefill-tokens
        budget = _flag(argv, "--max-prefill-tokens") if args.max_prefill_tokens else f"{SGLANG}'s --max-prefill-tokens"
        serving["max_prefill_tokens"] = Sourced(args.max_prefill_tokens or SGLANG_MAX_PREFILL_TOKENS,
                                                f"{_flag(argv, '--chunked-prefill-size')} (off): {budget}")
    elif by_memory:
        serving["max_prefill_tokens"] = Sourced(by_memory[1], f"{SGLANG}'s default chunked-prefill size for the "
                                                              f"{profile.name}'s memory")
    else:
        notes.append("prefill token budget: not written (sglang sizes its chunked prefill by the device's memory: "
                     "add --chunked-prefill-size N or name the device in --target); the provider's default applies")
    return serving, mrr, notes


def _vllm_defaults(profile, mode: str) -> tuple[int, int, str] | None:
    """vLLM 0.34.0's `vllm serve` defaults (max_num_seqs, max_num_batched_tokens, why) for a device profile."""
    memory = _memory(profile)
    if memory is None:
        return None
    if memory >= 160 * _GIB:
        seqs, tokens, tier = 1024, 16384, "160 GiB or more"
    elif memory >= 70 * _GIB and "a100" not in profile.name.lower():
        seqs, tokens, tier = 1024, 8192, "70 GiB or more, not an A100"
    else:
        seqs, tokens, tier = 256, 2048, "under 70 GiB or an A100"
    if mode == "throughput":
        return 2 * seqs, 2 * tokens, f"for the {profile.name} ({tier}), doubled by --performance-mode throughput"
    return seqs, tokens, f"for the {profile.name} ({tier})"


def _vllm_grid(top: int) -> list[int]:
    """vLLM's stride grid up to ``top``: 1, 2, 4, then every 8th below 256, then every 16th (capture sizes in
    tokens, and the request counts of uniform decode batches alike)."""
    return [*(s for s in (1, 2, 4) if s <= top), *range(8, min(top + 1, 256), 8), *range(256, top + 1, 16)]


def _vllm_capture_sizes(top: int, tokens: int | None, seqs: int | None, query: int, mode: str,
                        ceiling: int) -> list[int]:
    """VllmConfig._set_cudagraph_sizes' default list (tokens) up to ``top``."""
    fine = list(range(1, min(top, 32) + 1)) if mode == "interactivity" else []  # every small size first
    sizes = fine + _vllm_grid(top)
    if tokens is not None and tokens <= top:
        sizes.append(tokens)
    if seqs is not None:  # uniform decode batches: requests x query tokens, as many as fit
        requests = min(seqs, ceiling)
        counts = {*_vllm_grid(requests), requests}
        uniform = sorted(n * query for n in counts if n * query <= top) if query > 1 else \
            ([seqs] if seqs <= top else [])
        sizes += [s for s in uniform if tokens is None or s <= tokens]
    return sorted(set(sizes))


def _config_ints(compilation: dict, key: str, many: bool = False):
    """--compilation-config's ``key``: a positive int (``many``: a list of them; a dotted ``key+ 1,2`` gives strings,
    which vLLM's config then reads as ints)."""
    if (value := compilation.get(key)) is None:
        return None
    ints = [int(v) if isinstance(v, str) and v.isdecimal() else v for v in (value if many else [value])] \
        if isinstance(value, list) == many else []
    if not ints or not all(map(_positive_int, ints)):
        raise ManifestError(f"--compilation-config {key} = {json.dumps(value)}: expected "
                            f"{'a list of positive integers' if many else 'a positive integer'}")
    return ints if many else ints[0]


def _vllm_serving(args, argv, profile, arch: str):
    """The same from vLLM's flags: capture sizes are token counts, (1 + speculative tokens) per decode request."""
    notes: list[str] = []
    serving: dict[str, Sourced] = {}
    mode = args.performance_mode or "balanced"
    defaults = _vllm_defaults(profile, mode)
    if args.max_num_seqs:
        seqs = Sourced(args.max_num_seqs, _flag(argv, "--max-num-seqs"))
    elif defaults:
        seqs = Sourced(defaults[0], f"{VLLM}'s default max_num_seqs {defaults[2]}")
    else:
        seqs = None
    if args.max_num_batched_tokens:
        tokens = Sourced(args.max_num_batched_tokens, _flag(argv, "--max-num-batched-tokens"))
    elif defaults:
        tokens = Sourced(defaults[1], f"{VLLM}'s default max_num_batched_tokens {defaults[2]}")
    else:
        tokens = None
        notes.append("prefill token budget: not written (vLLM's --max-num-batched-tokens default depends on the "
                     "device: add it or name the device in --target); the provider's default applies")

    drafts = 0
    if args.speculative_config is not None:
        drafts = args.speculative_config.get("num_speculative_tokens")
        if not _positive_int(drafts):
            raise ManifestError(f"--speculative-config {json.dumps(args.speculative_config)}: num_speculative_tokens "
                                "is missing: add it (the verify width is num_speculative_tokens + 1)")
    compilation = args.compilation_config or {}
    graph_mode = str(compilation.get("cudagraph_mode", "")).upper()
    eager = None  # what turns CUDA graphs off, if anything does
    if args.enforce_eager:
        eager = "--enforce-eager"
    elif graph_mode == "NONE":
        eager = "--compilation-config cudagraph_mode NONE"
    elif not graph_mode and args.optimization_level == "0":
        eager = "--optimization-level 0 (its cudagraph_mode is NONE)"
    given = args.cudagraph_capture_sizes or _config_ints(compilation, "cudagraph_capture_sizes", many=True)
    top = args.max_cudagraph_capture_size or _config_ints(compilation, "max_cudagraph_capture_size")
    ceiling = 1024 if re.fullmatch(r"sm_10\d+a?", arch) else 512  # is_device_capability_family(100)
    if eager:
        if seqs is None:
            raise ManifestError(f"decode batch buckets: {eager} runs decode batches of every size up to "
                                "--max-num-seqs, whose default depends on the device: add --max-num-seqs N or name the "
                                "device in --target BACKEND:ARCH:DEVICE")
        sizes, how = list(range(1, seqs.value + 1)), f"{eager}: no CUDA graphs, eager decode batches of every size"
    elif given:
        sizes = sorted({s for s in given if tokens is None or s <= tokens.value})
        how = (_flag(argv, "--cudagraph-capture-sizes", many=True) if args.cudagraph_capture_sizes
               else "--compilation-config cudagraph_capture_sizes")
    elif seqs is None:
        raise ManifestError("decode batch buckets: vLLM derives its CUDA-graph sizes from --max-num-seqs, whose "
                            "default depends on the device: add --cudagraph-capture-sizes N ... or --max-num-seqs N "
                            "to the launch arguments, or name the device in --target BACKEND:ARCH:DEVICE")
    else:
        top = top or min(seqs.value * (1 + drafts) * 2, ceiling)
        top = min(top, tokens.value) if tokens is not None else top
        sizes = _vllm_capture_sizes(top, tokens and tokens.value, seqs.value, 1 + drafts, mode, ceiling)
        how = f"{VLLM}'s default capture sizes up to {top}" + (f" ({mode} mode)" if mode != "balanced" else "")
    if drafts and not eager:  # uniform decode batches of (1 + K) tokens per request
        sizes = sorted({math.ceil(s / (1 + drafts)) for s in sizes})
        how += f", as requests of {1 + drafts} tokens"
    if seqs is not None:
        sizes = [s for s in sizes if s <= seqs.value] or [seqs.value]
        how += f", at most {seqs.value} requests ({seqs.source})"
    serving["decode_batch_buckets"] = Sourced(sizes, how)
    if drafts:
        serving["draft_widths"] = Sourced([drafts + 1], f"--speculative-config num_speculative_tokens {drafts} + 1 "
                                                        "(the verify step reads the last token and the drafts)")
    else:
        notes.append("draft widths: none (no --speculative-config: no speculative verify)")
    if tokens is not None:
        serving["max_prefill_tokens"] = tokens
    return serving, seqs, notes


def _check(gen: GeneratedManifest) -> None:
    """Load the manifest as `prewarm plan` would and read its spec as the KDA providers do: a value the kernels
    cannot plan (heads that do not divide over the attention ranks...) is an error naming its sources."""
    from prewarm_kernels.spec import SpecError, read_kda

    from .manifest import load

    with tempfile.TemporaryDirectory(prefix="prewarm-manifest-") as tmp:
        path = Path(tmp) / "manifest.toml"
        path.write_text(gen.toml())
        m = load(path)
    try:
        if "sglang" in m.spec():
            from .providers.sglang.common import read_spec

            read_spec(m.spec())
        elif gen.kernels == "vllm":
            from .providers.vllm_kda import read_spec

            read_spec(m.spec())
        else:
            read_kda(m.spec())
    except SpecError as e:
        table, _, key = e.key.partition(".")
        sources = [f"{table}.{key} from {gen.spec[table][key].source}"] if key in gen.spec.get(table, {}) else []
        if table in ("model", "parallel"):
            sources += [f"parallel.{k} from {v.source}" for k, v in gen.spec["parallel"].items()]
        raise ManifestError(f"{e} ({'; '.join(dict.fromkeys(sources))})") from None


def write(gen: GeneratedManifest, output: str | Path) -> Path:
    """Write the manifest whole or not at all."""
    from .cachedir import write_atomic

    path = Path(output)
    try:
        write_atomic(path, gen.toml().encode())
    except OSError as e:
        raise EnvironmentProblem(f"-o {output}: cannot write it: {e.strerror}") from e
    return path
