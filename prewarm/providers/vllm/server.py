"""vLLM as a server: what ``prewarm manifest --server vllm`` reads from its launch line.

vLLM 0.34.0 (``vllm/config/vllm.py`` ``VllmConfig._set_cudagraph_sizes``, ``vllm/engine/arg_utils.py``
``EngineArgs.get_batch_defaults``, ``vllm/utils/argparse_utils.py``): capture sizes (tokens) ``[1, 2, 4] +
range(8, 256, 8) + range(256, top + 1, 16)`` (``--performance-mode interactivity``: every size up to 32 first) with
top = min(max_num_seqs * (1 + speculative tokens) * 2, 1024 on sm_10x else 512, max_num_batched_tokens), plus
max_num_batched_tokens and the uniform decode sizes (requests x (1 + speculative tokens)) that fit; the `vllm serve`
defaults max_num_seqs / max_num_batched_tokens 1024 / 16384 on a device of 160 GiB or more, 1024 / 8192 on 70 GiB or
more that is not an A100, else 256 / 2048, both doubled by ``--performance-mode throughput``; no CUDA graphs with
``--enforce-eager``, ``-O0`` or ``cudagraph_mode`` NONE (decode batches of every size then). Its spellings: ``--a_b``
for ``--a-b``, ``-O3``, dotted ``-cc.key value`` / ``--speculative-config.key=value``.
"""
from __future__ import annotations

import argparse
import json
import math
import re

from ...errors import ManifestError
from ...planning.manifestgen import (GIB, NUMBER, Sourced, device_memory, flag_source, json_object_arg, positive_int,
    positive_int_arg)
from ..contract import Server

VERSION = "vLLM 0.34.0"


class Vllm(Server):
    name = "vllm"
    version = VERSION
    kernel_providers = {"*": "prewarm.providers.vllm.kda"}
    reads_running_requests = True
    default_kernels = "vllm"  # its own KDA kernels

    def argv(self, argv: list[str]) -> list[str]:
        return _argv(list(argv))

    def add_flags(self, parser) -> None:
        parser.add_argument("--tensor-parallel-size", "-tp", type=positive_int_arg)
        parser.add_argument("--max-num-seqs", type=positive_int_arg)
        parser.add_argument("--max-num-batched-tokens", type=positive_int_arg)
        parser.add_argument("--max-model-len", type=positive_int_arg)
        parser.add_argument("--max-logprobs", type=int)
        parser.add_argument("--cudagraph-capture-sizes", type=positive_int_arg, nargs="+")
        parser.add_argument("--max-cudagraph-capture-size", type=positive_int_arg)
        parser.add_argument("--compilation-config", "-cc", type=json_object_arg)
        parser.add_argument("--speculative-config", type=json_object_arg)
        parser.add_argument("--performance-mode", choices=("balanced", "interactivity", "throughput"))
        parser.add_argument("--optimization-level", choices=("0", "1", "2", "3"))
        parser.add_argument("--enforce-eager", action="store_true")
        parser.add_argument("--mamba-cache-dtype", choices=("auto", "float32", "float16", "bfloat16"))
        parser.add_argument("--mamba-ssm-cache-dtype", choices=("auto", "float32", "float16", "bfloat16"))
        parser.add_argument("--kv-cache-dtype")
        parser.add_argument("--block-size", type=positive_int_arg)
        parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)

    def parallel(self, args, argv: list[str]) -> dict[str, Sourced]:
        tp = Sourced(args.tensor_parallel_size or 1, flag_source(argv, "--tensor-parallel-size", "-tp")
                     if args.tensor_parallel_size else f"{VERSION}'s default (no --tensor-parallel-size)")
        return {"tensor_parallel": tp,
                "attention_dp": Sourced(1, "vLLM: every data-parallel rank holds a whole TP group (attention-TP = TP)")}

    def serving(self, args, argv, profile, arch):
        return _serving(args, argv, profile, arch)

    def own_kernels_spec(self, args, argv, cfg, serving, backend):
        return _layer_spec(args, argv, cfg, self.parallel(args, argv)["tensor_parallel"].value), []

    def check_spec(self, spec: dict) -> None:
        from .kda import read_spec

        read_spec(spec)


def _argv(argv: list[str]) -> list[str]:
    """A vLLM launch line in the spelling :meth:`Vllm.add_flags` reads, as vLLM's FlexibleArgumentParser rewrites it
    first: ``--a_b`` is ``--a-b``; ``-O3`` / ``-O=3`` / ``-O 3`` is ``--optimization-level 3``; dotted keys of a JSON
    flag (``-cc.cudagraph_mode=NONE``, ``--speculative-config.num_speculative_tokens 3``, ``key+ a,b`` for a list) are
    merged into that flag's object."""
    if "--cuda-graph-sizes" in (w.split("=", 1)[0] for w in argv):
        raise ManifestError(f"--cuda-graph-sizes: not a {VERSION} flag (vLLM renamed it --cudagraph-capture-sizes): "
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
        if word.startswith("-") and "." in key and not NUMBER.fullmatch(word):  # (a negative value is no flag)
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


def _defaults(profile, mode: str) -> tuple[int, int, str] | None:
    """vLLM 0.34.0's `vllm serve` defaults (max_num_seqs, max_num_batched_tokens, why) for a device profile."""
    memory = device_memory(profile)
    if memory is None:
        return None
    if memory >= 160 * GIB:
        seqs, tokens, tier = 1024, 16384, "160 GiB or more"
    elif memory >= 70 * GIB and "a100" not in profile.name.lower():
        seqs, tokens, tier = 1024, 8192, "70 GiB or more, not an A100"
    else:
        seqs, tokens, tier = 256, 2048, "under 70 GiB or an A100"
    if mode == "throughput":
        return 2 * seqs, 2 * tokens, f"for the {profile.name} ({tier}), doubled by --performance-mode throughput"
    return seqs, tokens, f"for the {profile.name} ({tier})"


def _grid(top: int) -> list[int]:
    """vLLM's stride grid up to ``top``: 1, 2, 4, then every 8th below 256, then every 16th (capture sizes in
    tokens, and the request counts of uniform decode batches alike)."""
    return [*(s for s in (1, 2, 4) if s <= top), *range(8, min(top + 1, 256), 8), *range(256, top + 1, 16)]


def _capture_sizes(top: int, tokens: int | None, seqs: int | None, query: int, mode: str,
                        ceiling: int) -> list[int]:
    """VllmConfig._set_cudagraph_sizes' default list (tokens) up to ``top``."""
    fine = list(range(1, min(top, 32) + 1)) if mode == "interactivity" else []  # every small size first
    sizes = fine + _grid(top)
    if tokens is not None and tokens <= top:
        sizes.append(tokens)
    if seqs is not None:  # uniform decode batches: requests x query tokens, as many as fit
        requests = min(seqs, ceiling)
        counts = {*_grid(requests), requests}
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
    if not ints or not all(map(positive_int, ints)):
        raise ManifestError(f"--compilation-config {key} = {json.dumps(value)}: expected "
                            f"{'a list of positive integers' if many else 'a positive integer'}")
    return ints if many else ints[0]


def _serving(args, argv, profile, arch: str):
    """The same from vLLM's flags: capture sizes are token counts, (1 + speculative tokens) per decode request."""
    notes: list[str] = []
    serving: dict[str, Sourced] = {}
    mode = args.performance_mode or "balanced"
    defaults = _defaults(profile, mode)

    def given_or_default(value: int | None, flag: str, field: str, default: int) -> Sourced | None:
        """The flag's value, else vLLM's default for the device (None: no device named)."""
        if value:
            return Sourced(value, flag_source(argv, flag))
        return Sourced(defaults[default], f"{VERSION}'s default {field} {defaults[2]}") if defaults else None

    seqs = given_or_default(args.max_num_seqs, "--max-num-seqs", "max_num_seqs", 0)
    tokens = given_or_default(args.max_num_batched_tokens, "--max-num-batched-tokens", "max_num_batched_tokens", 1)
    if tokens is None:
        notes.append("prefill token budget: not written (vLLM's --max-num-batched-tokens default depends on the "
                     "device: add it or name the device in --target); the provider's default applies")

    drafts = 0
    if args.speculative_config is not None:
        drafts = args.speculative_config.get("num_speculative_tokens")
        if not positive_int(drafts):
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
        how = (flag_source(argv, "--cudagraph-capture-sizes", many=True) if args.cudagraph_capture_sizes
               else "--compilation-config cudagraph_capture_sizes")
    elif seqs is None:
        raise ManifestError("decode batch buckets: vLLM derives its CUDA-graph sizes from --max-num-seqs, whose "
                            "default depends on the device: add --cudagraph-capture-sizes N ... or --max-num-seqs N "
                            "to the launch arguments, or name the device in --target BACKEND:ARCH:DEVICE")
    else:
        top = top or min(seqs.value * (1 + drafts) * 2, ceiling)
        top = min(top, tokens.value) if tokens is not None else top
        sizes = _capture_sizes(top, tokens and tokens.value, seqs.value, 1 + drafts, mode, ceiling)
        how = f"{VERSION}'s default capture sizes up to {top}" + (f" ({mode} mode)" if mode != "balanced" else "")
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


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _layer_spec(args, argv, cfg, tp: int) -> dict:
    """The geometry vLLM 0.34.0 gives Kimi-Linear's KDA layer on this launch line (``[spec.vllm]``: the state page
    padded to the MLA attention page, the recurrent slot stride, the conv kernel and state dtype, custom_ops as vLLM
    completes them, the cache mode) and the layer's own dtypes (``[spec.dtypes]``: the gate and beta in the model
    dtype, fp32 A_log / dt_bias, the recurrent state per --mamba-ssm-cache-dtype)."""
    from ...planning.manifestgen import _activation
    from .layer import custom_ops_setting, padded_page, page_bytes

    heads = cfg.linear("num_heads", positive_int, "a positive integer (KDA heads, all ranks)")
    head_dim = cfg.linear("head_dim", positive_int, "a positive integer (the KDA head dim)")
    heads_per_rank = heads // tp if heads % tp == 0 else heads  # read_kda says what does not divide
    model = _activation(args, argv, cfg).value
    ssm = args.mamba_ssm_cache_dtype or "auto"
    if ssm not in ("auto", "float32", "bfloat16"):
        raise ManifestError(f"--mamba-ssm-cache-dtype {ssm}: vLLM's KDA recurrent state takes auto, float32 or "
                            "bfloat16 (MambaStateDtypeCalculator.kda_state_dtype)")
    state = "float32" if ssm == "auto" else ssm
    dtypes = {
        "gate": Sourced(model, "KimiGatedDeltaNetAttention: g1 is f_b_proj's output, in the model dtype"),
        "beta": Sourced(model, "KimiGatedDeltaNetAttention: raw beta is a slice of in_proj's output"),
        "gate_params": Sourced("float32", "KimiGatedDeltaNetAttention: A_log and dt_bias are fp32 parameters"),
        "state": Sourced(state, flag_source(argv, "--mamba-ssm-cache-dtype") if args.mamba_ssm_cache_dtype else
                         "no --mamba-ssm-cache-dtype: vLLM keeps the KDA state in fp32")}
    conv_dtype = model if (args.mamba_cache_dtype or "auto") == "auto" else args.mamba_cache_dtype
    conv_src = (flag_source(argv, "--mamba-cache-dtype") if args.mamba_cache_dtype not in (None, "auto")
                else "--mamba-cache-dtype auto: the model dtype")
    width = cfg.linear("short_conv_kernel_size", positive_int, "a positive integer (the short conv's kernel)")
    drafts = (args.speculative_config or {}).get("num_speculative_tokens") or 0
    page = page_bytes(heads_per_rank, head_dim, width, drafts, conv_dtype, state)
    page_src = (f"conv state ({width} - 1 + {drafts} speculative) x 3 x {heads_per_rank} x {head_dim} {conv_dtype} "
                f"+ recurrent state {heads_per_rank} x {head_dim} x {head_dim} {state}: {page} B")
    lora, rope = cfg.doc.get("kv_lora_rank"), cfg.doc.get("qk_rope_head_dim")
    kv = args.kv_cache_dtype or "auto"
    if positive_int(lora) and positive_int(rope):  # MLA: the mamba page is padded to the attention page
        sizes = {"auto": DTYPE_BYTES[model], "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
        if kv not in sizes:
            raise ManifestError(f"--kv-cache-dtype {kv}: its MLA page per token is not derived here (auto, bfloat16, "
                                "float16, fp8): add [spec.vllm] mamba_page_bytes = [layer.kv_cache[1].stride(0) * "
                                f"{DTYPE_BYTES[state]}] as a server has it")
        per_token = (lora + rope) * sizes[kv]
        page, tokens = padded_page(page, per_token, args.block_size)
        page_src += (f", padded to the attention page: {tokens} tokens x ({cfg.source('kv_lora_rank')} {lora} + "
                     f"{cfg.source('qk_rope_head_dim')} {rope}) x {sizes[kv]} B (--kv-cache-dtype {kv}) (check: vLLM "
                     f"logs 'Setting attention block size to {tokens} tokens', and layer.kv_cache[1].stride(0) = "
                     f"{page // DTYPE_BYTES[state]})")
    ops, ops_why = custom_ops_setting(cfg.top.get("architectures") or [], args.compilation_config or {},
                                      args.enforce_eager, args.optimization_level, {})
    caching = args.enable_prefix_caching is not False
    layer = {
        "mamba_page_bytes": Sourced([page], page_src),
        "state_slot_strides": Sourced([page // DTYPE_BYTES[state]], f"the recurrent state's slot stride: the page / "
                                      f"{DTYPE_BYTES[state]} ({state})"),
        "conv_kernel_size": Sourced(width, cfg.source("linear_attn_config.short_conv_kernel_size")),
        "conv_state_dtype": Sourced(conv_dtype, conv_src),
        "custom_ops": Sourced([ops], ops_why + " (VLLM_USE_BREAKABLE_CUDAGRAPH / TORCH_COMPILE_DISABLE in the "
                              "server's environment can change it: list each setting a server may run)"),
        "mamba_cache_mode": Sourced("align" if caching else "none",
                                    "--no-enable-prefix-caching" if not caching else
                                    (flag_source(argv, "--enable-prefix-caching") if args.enable_prefix_caching else
                                     f"{VERSION} enables prefix caching for a hybrid model by default")),
    }
    if positive_int(lora) and positive_int(rope):  # the hybrid state's bookkeeping (prewarm.providers.vllm.mamba)
        layer["block_size"] = Sourced(tokens, f"the attention block vLLM sets for the hybrid page (check: vLLM logs "
                                      f"'Setting attention block size to {tokens} tokens')")
        layer["mamba_groups"] = _mamba_groups(cfg)
    if (args.speculative_config or {}).get("method") == "mtp" and positive_int(cfg.doc.get("hidden_size")):
        layer["draft_hidden_size"] = Sourced(cfg.doc["hidden_size"], f"{cfg.source('hidden_size')} (--speculative-"
                                             "config method mtp: the MTP layer's width, prewarm.providers.vllm."
                                             "speculator)")
    layer.update(_model_spec(args, argv, cfg))
    return {"dtypes": dtypes, "vllm": layer}


def _mamba_groups(cfg) -> Sourced:
    """The KV-cache groups vLLM's hybrid allocator makes of the KDA layers (``_get_kv_cache_groups_uniform_page_size``,
    ``v1/core/kv_cache_planning.py``: each layer type split into groups of the smaller type's layer count, or of the
    larger's where it is under 1.5 times the smaller)."""
    kda = len(cfg.linear("kda_layers", lambda v: isinstance(v, list) and v, "a non-empty list (the KDA layers)"))
    total = cfg.doc.get("num_hidden_layers")
    attention = total - kda if positive_int(total) and total > kda else 0
    if not attention:
        return Sourced(1, f"{cfg.source('linear_attn_config.kda_layers')}: {kda} KDA layers, no attention layer: one "
                       "group")
    small, large = min(kda, attention), max(kda, attention)
    size = large if large < small * 1.5 else small
    groups = -(-kda // size)
    return Sourced(groups, f"vLLM's hybrid allocator: {kda} KDA layers ({cfg.source('linear_attn_config.kda_layers')}"
                   f") in KV-cache groups of {size} (the {attention} attention layers of "
                   f"{cfg.source('num_hidden_layers')} {total}): {groups} (check: the KV cache groups vLLM logs)")


# vLLM 0.34.0's max_model_len from a model config (ModelArchConfigConvertor.derive_max_model_len_and_key): the
# smallest of these keys present, model_max_length winning where set
MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")


def _model_spec(args, argv, cfg) -> dict:
    """The model around the KDA layers (``prewarm.providers.vllm.moe``, ``.runner``): the MoE's widths from
    config.json (where it has routed experts), the runner's max_model_len (--max-model-len, else config.json's as
    vLLM derives it) and vocabulary, and --max-logprobs where the launch line raises or lowers it."""
    out = {}
    if positive_int(cfg.doc.get("num_experts")):
        for key, field in (("moe_experts", "num_experts"), ("moe_top_k", "num_experts_per_token"),
                           ("moe_hidden_size", "hidden_size"), ("moe_intermediate_size", "moe_intermediate_size")):
            if not positive_int(cfg.doc.get(field)):
                raise ManifestError(f"{cfg.path}: {cfg.prefix}{field} = {cfg.doc.get(field)!r}: expected a positive "
                                    "integer (the MoE's widths)")
            out[key] = Sourced(cfg.doc[field], cfg.source(field))
    lengths = {k: cfg.doc[k] for k in MAX_LEN_KEYS if positive_int(cfg.doc.get(k))}
    if args.max_model_len:
        out["max_model_len"] = Sourced(args.max_model_len, flag_source(argv, "--max-model-len"))
    elif lengths:
        key = "model_max_length" if "model_max_length" in lengths else min(lengths, key=lengths.get)
        out["max_model_len"] = Sourced(lengths[key], f"no --max-model-len: {cfg.source(key)}")
    if "max_model_len" in out and positive_int(cfg.doc.get("vocab_size")):
        out["vocab_size"] = Sourced(cfg.doc["vocab_size"], cfg.source("vocab_size"))
        if args.max_logprobs is not None:  # absent: vLLM's default (prewarm.providers.vllm.runner.MAX_LOGPROBS)
            if args.max_logprobs < -1:
                raise ManifestError(f"--max-logprobs {args.max_logprobs}: vLLM takes a count >= 0, or -1 (no cap)")
            from .runner import MAX_LOGPROBS

            out["max_logprobs"] = Sourced(args.max_logprobs, flag_source(argv, "--max-logprobs") + (
                f" (-1: no cap; counts above vLLM's default {MAX_LOGPROBS} are named, not planned)"
                if args.max_logprobs < 0 else ""))
    else:
        out.pop("max_model_len", None)  # the runner's kernels need both
    return out
