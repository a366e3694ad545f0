"""sglang as a server: what ``prewarm manifest --server sglang`` reads from its launch line, and what its processes
do to the cache dirs (``verify --server sglang``).

Launch line and defaults (sglang 0.5.23, ``sglang/srt/arg_groups``): decode CUDA-graph batch sizes
``generate_decode_cuda_graph_batch_sizes`` up to a max batch size that ``memory_hook`` picks from the device's memory
and the TP size (capped by ``--max-running-requests`` when defaulted), the chunked-prefill size from the same table,
DSPARK's ``max_running_requests`` 48; attention-TP = tp / attention-DP (``derive_attn_tp_size``); without a decode
graph (``--disable-cuda-graph``, ``--disable-decode-cuda-graph``, ``--cuda-graph-backend-decode disabled``, or
``--cuda-graph-config``'s decode object, which wins over the flags: ``_parse_cuda_graph_config``) decode batches of
every size up to ``--max-running-requests``.

Cache dirs: ``import sglang`` (its package init calls ``sglang.srt.environ.redirect_third_party_caches`` before
anything else) sets ``TRITON_CACHE_DIR`` to ``$SGLANG_CACHE_DIR/triton`` (``~/.cache/sglang/triton``) where the
variable is unset, and ``TORCHINDUCTOR_CACHE_DIR``, ``CUDA_CACHE_PATH``, ``TILELANG_CACHE_DIR`` and
``FLASHINFER_WORKSPACE_BASE`` beside it: a server started without the pre-launch job's environment then reads none of
the installed cache. :attr:`Sglang.imports` is what ``verify --server sglang`` runs to see it (prewarm.node.serverenv).
"""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

from ...errors import ManifestError
from ...planning.manifestgen import (MIB, ModelConfig, Sourced, device_memory, flag_source, json_object_arg,
    positive_int, positive_int_arg)
from ..contract import Server

VERSION = "sglang 0.5.23"
# sglang 0.5.23 memory_hook: (device memory below, MiB) -> (chunked_prefill_size, decode max_bs tp < 4, tp >= 4)
_BY_MEMORY = ((20 * 1024, 2048, 8, 8), (35 * 1024, 4096, 48, 160), (60 * 1024, 4096, 32, 160),
              (90 * 1024, 8192, 256, 512), (160 * 1024, 8192, 256, 512), (math.inf, 16384, 512, 512))
MAX_PREFILL_TOKENS = 16384  # --max-prefill-tokens' default: the budget when chunked prefill is off (-1)
DSPARK_MAX_RUNNING = 48  # _handle_dspark: max_running_requests when not given
# switches that make sglang's KDA layer run kernels the sglang providers do not plan (refused by name: _refused)
UNPLANNED_SWITCHES = {
    "--enable-linear-replayssm": "ReplaySSM's decode ring (its replay kernels; the ring length is a constexpr)",
    "--enable-linear-replayssm-spec": "ReplaySSM's spec-verify fold (its ring-write and commit kernels)",
    "--enable-int8-mamba-checkpoint": "the int8 checkpoint pool's quantize/dequantize kernels",
    "--enable-mamba-cache-stochastic-rounding": "the stochastic-rounding state writes (fp16 pools)",
}


class Sglang(Server):
    name = "sglang"
    version = VERSION
    kernel_providers = {"cuda": "prewarm.providers.sglang.cuda", "npu": "prewarm.providers.sglang.ascend"}
    jit_library = "prewarm.providers.sglang.jit:SglangJit"
    reads_running_requests = True
    imports = "sglang"  # python -m sglang.launch_server
    jit_libraries = ("sglang", "flashinfer")  # its load_jit modules; FlashInfer's sampling module

    def add_flags(self, parser) -> None:
        parser.add_argument("--tp-size", "--tensor-parallel-size", type=positive_int_arg)
        parser.add_argument("--dp-size", "--data-parallel-size", type=positive_int_arg)
        parser.add_argument("--enable-dp-attention", action="store_true")
        parser.add_argument("--attn-dp-size", "--attention-data-parallel-size", type=positive_int_arg)
        parser.add_argument("--attn-cp-size", "--attention-context-parallel-size", type=positive_int_arg)
        parser.add_argument("--cuda-graph-bs", "--cuda-graph-bs-decode", type=positive_int_arg, nargs="+")
        parser.add_argument("--cuda-graph-max-bs", "--cuda-graph-max-bs-decode", type=positive_int_arg)
        parser.add_argument("--disable-cuda-graph-padding", action="store_true")
        parser.add_argument("--disable-cuda-graph", action="store_true")
        parser.add_argument("--disable-decode-cuda-graph", action="store_true")
        parser.add_argument("--cuda-graph-backend-decode", choices=("full", "breakable", "disabled"))
        parser.add_argument("--cuda-graph-config", type=json_object_arg)
        parser.add_argument("--max-running-requests", type=positive_int_arg)
        parser.add_argument("--speculative-algorithm")
        parser.add_argument("--speculative-num-draft-tokens", type=positive_int_arg)
        parser.add_argument("--speculative-dspark-block-size", type=positive_int_arg)
        parser.add_argument("--chunked-prefill-size", type=int)
        parser.add_argument("--max-prefill-tokens", type=positive_int_arg)
        parser.add_argument("--max-mamba-cache-size", type=positive_int_arg)
        parser.add_argument("--disable-radix-cache", action="store_true")
        parser.add_argument("--mamba-radix-cache-strategy", choices=("auto", "no_buffer", "extra_buffer",
                                                                     "extra_buffer_lazy"))
        parser.add_argument("--mamba-ssm-dtype", choices=("float32", "bfloat16", "float16"))
        parser.add_argument("--sampling-backend")
        # the options that change which kernels the KDA layer runs (_refused)
        for backend in ("", "decode-", "prefill-", "verify-"):
            parser.add_argument(f"--linear-attn-{backend}backend")
        parser.add_argument("--cuda-graph-backend-prefill", choices=("full", "breakable", "disabled"))
        for switch in UNPLANNED_SWITCHES:
            parser.add_argument(switch, action="store_true")

    def parallel(self, args, argv: list[str]) -> dict[str, Sourced]:
        if args.attn_cp_size and args.attn_cp_size > 1:
            given = flag_source(argv, "--attn-cp-size", "--attention-context-parallel-size")
            raise ManifestError(f"{given}: attention context parallelism splits the KDA heads another way than "
                                "[spec.parallel] describes (attention-TP = tensor_parallel / attention_dp): "
                                "not supported")
        tp = Sourced(args.tp_size or 1, flag_source(argv, "--tp-size", "--tensor-parallel-size") if args.tp_size
                     else f"{VERSION}'s default (no --tp-size)")
        if args.attn_dp_size:
            dp = Sourced(args.attn_dp_size, flag_source(argv, "--attn-dp-size", "--attention-data-parallel-size"))
        elif args.enable_dp_attention:
            dp = Sourced(args.dp_size or 1, f"{flag_source(argv, '--dp-size', '--data-parallel-size')} with "
                                            "--enable-dp-attention (sglang's deprecated spelling of --attn-dp-size)")
        else:
            why = "--dp-size without --enable-dp-attention: replicas" if args.dp_size else "no DP attention"
            dp = Sourced(1, f"{why} (attention-TP = the TP size)")
        return {"tensor_parallel": tp, "attention_dp": dp}

    def serving(self, args, argv, profile, arch):
        return _serving(args, argv, profile)

    def own_kernels_spec(self, args, argv, cfg, serving, backend):
        _refused(args, argv)
        tables = {}
        if args.mamba_ssm_dtype:  # the state pools' dtype (default: the model config's, fp32)
            tables["dtypes"] = {"state": Sourced([args.mamba_ssm_dtype], flag_source(argv, "--mamba-ssm-dtype"))}
        if backend == "npu":
            return tables | {"sglang": _ascend(args, argv, cfg, serving)}, []
        dp = self.parallel(args, argv)["attention_dp"].value
        return tables | {"sglang": _cuda(args, argv, cfg, dp, serving.get("max_running_requests"))}, []

    def check_spec(self, spec: dict) -> None:
        from .common import read_spec

        read_spec(spec)


def _ascend(args, argv: list[str], cfg: ModelConfig, serving: dict[str, Sourced]) -> dict[str, Sourced]:
    """``[spec.sglang]`` of sglang's Ascend KDA backend (prewarm.providers.sglang.ascend): the pools' geometry that
    reaches a constexpr, and the radix cache's state tracking."""
    out = {"track_state": _tracking(args, argv)}
    if args.max_mamba_cache_size:
        out["mamba_pool_slots"] = Sourced(args.max_mamba_cache_size + 1,
                                          f"{flag_source(argv, '--max-mamba-cache-size')} + the pool's padding slot")
    elif "draft_widths" in serving:
        raise ManifestError("mamba pool slots: sglang's Ascend verify rolls the conv state back with the conv pool's "
                            "strides as constexprs, and sglang sizes that pool from the device's memory at startup: "
                            "add --max-mamba-cache-size N to the launch arguments")
    out["conv_kernel"] = _conv_kernel(cfg)
    return out


def _tracking(args, argv: list[str]) -> Sourced:
    """Whether the radix cache tracks KDA state: off with --disable-radix-cache or --mamba-radix-cache-strategy
    no_buffer; ``auto`` (the default) keeps an extra buffer under the overlap scheduler (overrides.py)."""
    if args.disable_radix_cache:
        return Sourced(False, "--disable-radix-cache (no state tracking)")
    if args.mamba_radix_cache_strategy == "no_buffer":
        return Sourced(False, f"{flag_source(argv, '--mamba-radix-cache-strategy')} (no state tracking)")
    how = flag_source(argv, "--mamba-radix-cache-strategy") if args.mamba_radix_cache_strategy else \
        "--mamba-radix-cache-strategy auto, the default: an extra buffer under the overlap scheduler"
    return Sourced(True, f"{VERSION}'s radix cache tracks KDA state ({how})")


def _conv_kernel(cfg: ModelConfig) -> Sourced:
    return Sourced(cfg.linear("short_conv_kernel_size", positive_int, "a positive integer (the short conv's kernel)"),
                   cfg.source("linear_attn_config.short_conv_kernel_size"))


def _refused(args, argv: list[str]) -> None:
    """sglang 0.5.23's options that make its KDA layer run kernels the sglang providers do not plan: a ManifestError
    naming the option (exit 3), never a plan that silently lacks them."""
    for backend in ("", "decode_", "prefill_", "verify_"):
        value = getattr(args, f"linear_attn_{backend}backend")
        if value not in (None, "triton"):
            flag = f"--linear-attn-{backend.replace('_', '-')}backend"
            raise ManifestError(f"{flag} {value}: the sglang providers plan sglang's Triton KDA kernels "
                                f"(--linear-attn-backend triton, the default); {value}'s kernels are another "
                                "library's, not planned")
    for switch, what in UNPLANNED_SWITCHES.items():
        if getattr(args, switch.removeprefix("--").replace("-", "_")):
            raise ManifestError(f"{switch}: {what} are not planned by the sglang providers")
    prefill = (args.cuda_graph_config or {}).get("prefill", {})
    prefill_backend = prefill.get("backend") if isinstance(prefill, dict) else None
    if "full" in (prefill_backend, args.cuda_graph_backend_prefill):
        raise ManifestError("a full prefill CUDA graph (--cuda-graph-backend-prefill full / --cuda-graph-config "
                            "prefill.backend full): KDA's extend on the graph's padded tables is not planned "
                            f"({VERSION} turns breakable prefill graphs off for KDA models itself)")


def _cuda(args, argv: list[str], cfg: ModelConfig, dp: int, mrr: Sourced | None) -> dict[str, Sourced]:
    """``[spec.sglang]`` of sglang's CUDA KDA backend (prewarm.providers.sglang.cuda): the mamba pool's slots (the
    conv kernels' constexpr ``num_cache_lines``: ``MambaPool``'s size + its padding slot, the size per attention-DP
    shard as kv_cache_configurator sets it), the conv kernel, the radix cache's tracking, the sampling backend
    (whose FlashInfer module the server JIT-builds at the first request with temperature > 0)."""
    from .common import SAMPLING_BACKENDS

    per_shard = f" // attention-DP {dp}" if dp > 1 else ""
    if args.max_mamba_cache_size:
        slots = Sourced(args.max_mamba_cache_size // dp + 1, f"{flag_source(argv, '--max-mamba-cache-size')}"
                                                             f"{per_shard} + the pool's padding slot")
    elif args.disable_radix_cache and mrr is not None:
        slots = Sourced(max(1, mrr.value // dp) + 1, f"--disable-radix-cache: the running-request cap "
                                                     f"({mrr.source}){per_shard} + the pool's padding slot")
    else:
        raise ManifestError("mamba pool slots: sglang's causal conv kernels take the mamba pool's slot count as a "
                            "constexpr, and sglang sizes that pool from the device's memory at startup: add "
                            "--max-mamba-cache-size N to the launch arguments")
    backend = args.sampling_backend or SAMPLING_BACKENDS[0]
    if backend not in SAMPLING_BACKENDS:
        raise ManifestError(f"--sampling-backend {backend}: the plan knows {', '.join(SAMPLING_BACKENDS)} "
                            f"(sglang's CUDA backends)")
    return {"mamba_pool_slots": slots, "conv_kernel": _conv_kernel(cfg), "track_state": _tracking(args, argv),
            "sampling_backend": Sourced(backend, "--sampling-backend" if args.sampling_backend else
                                        f"{VERSION}'s default where FlashInfer is installed")}


def _decode_sizes(max_bs: int, speculative: bool, no_padding: bool) -> list[int]:
    """sglang 0.5.23's generate_decode_cuda_graph_batch_sizes."""
    if no_padding:
        sizes = list(range(1, max_bs + 1))
    elif not speculative:
        sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, max_bs + 1, 32)]
    else:
        sizes = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 257, 8), *range(272, max_bs + 1, 16)]
    sizes = [s for s in sizes if s <= max_bs]
    return sizes if max_bs in sizes else [*sizes, max_bs]


def _decode_graph(args, argv) -> SimpleNamespace:
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
        backend, backend_source = args.cuda_graph_backend_decode, flag_source(argv, "--cuda-graph-backend-decode")
    elif args.disable_decode_cuda_graph or args.disable_cuda_graph:
        backend = "disabled"
        backend_source = "--disable-decode-cuda-graph" if args.disable_decode_cuda_graph else "--disable-cuda-graph"
    bs = max_bs = None
    if "bs" in given:
        if not isinstance(given["bs"], list) or not given["bs"] or not all(map(positive_int, given["bs"])):
            raise ManifestError(f"{where}.bs {json.dumps(given['bs'])}: expected a list of positive integers")
        bs = given["bs"], f"{where}.bs {json.dumps(given['bs'])}"
    elif args.cuda_graph_bs:
        bs = args.cuda_graph_bs, flag_source(argv, "--cuda-graph-bs", "--cuda-graph-bs-decode", many=True)
    if "max_bs" in given:
        if not positive_int(given["max_bs"]):
            raise ManifestError(f"{where}.max_bs {json.dumps(given['max_bs'])}: expected a positive integer")
        max_bs = given["max_bs"], f"{where}.max_bs {given['max_bs']}"
    elif args.cuda_graph_max_bs:
        max_bs = args.cuda_graph_max_bs, flag_source(argv, "--cuda-graph-max-bs", "--cuda-graph-max-bs-decode")
    return SimpleNamespace(backend=backend, backend_source=backend_source, bs=bs, max_bs=max_bs)


def _serving(args, argv, profile):
    """Decode buckets, draft widths, the prefill budget (sglang's spelling and defaults), the running-request cap."""
    notes: list[str] = []
    serving: dict[str, Sourced] = {}
    memory = device_memory(profile)
    by_memory = next(row for row in _BY_MEMORY if memory / MIB < row[0]) if memory else None
    algo = (args.speculative_algorithm or "").upper() or None
    if args.max_running_requests:
        mrr = Sourced(args.max_running_requests, flag_source(argv, "--max-running-requests"))
    elif algo == "DSPARK":
        mrr = Sourced(DSPARK_MAX_RUNNING, f"{VERSION}'s default with --speculative-algorithm DSPARK")
    else:
        mrr = None

    decode = _decode_graph(args, argv)
    if decode.backend == "disabled":  # no decode graph: eager batches of every size up to the request cap
        if mrr is None:
            raise ManifestError(f"decode batch buckets: {decode.backend_source} runs decode batches of every size up "
                                "to the running-request cap, which sglang sizes from its KV pool at startup: add "
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
            _decode_sizes(max_bs, bool(algo), args.disable_cuda_graph_padding),
            f"{VERSION}'s default CUDA-graph sizes ({kind}, {how})")

    if args.speculative_num_draft_tokens:
        serving["draft_widths"] = Sourced([args.speculative_num_draft_tokens],
                                          flag_source(argv, "--speculative-num-draft-tokens"))
    elif algo == "DSPARK" and args.speculative_dspark_block_size:
        serving["draft_widths"] = Sourced([args.speculative_dspark_block_size + 1],
                                          f"{flag_source(argv, '--speculative-dspark-block-size')} + 1 (DSPARK "
                                          "verifies "
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
        serving["max_prefill_tokens"] = Sourced(chunk, flag_source(argv, "--chunked-prefill-size"))
    elif chunk is not None:  # -1: chunking off, one prefill batch up to --max-prefill-tokens
        budget = flag_source(argv, "--max-prefill-tokens") if args.max_prefill_tokens else \
            f"{VERSION}'s --max-prefill-tokens"
        serving["max_prefill_tokens"] = Sourced(args.max_prefill_tokens or MAX_PREFILL_TOKENS,
                                                f"{flag_source(argv, '--chunked-prefill-size')} (off): {budget}")
    elif by_memory:
        serving["max_prefill_tokens"] = Sourced(by_memory[1], f"{VERSION}'s default chunked-prefill size for the "
                                                              f"{profile.name}'s memory")
    else:
        notes.append("prefill token budget: not written (sglang sizes its chunked prefill by the device's memory: "
                     "add --chunked-prefill-size N or name the device in --target); the provider's default applies")
    return serving, mrr, notes
