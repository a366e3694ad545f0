"""Everything that differs between the Triton releases prewarm supports (``release``: upstream 3.6 and 3.8,
triton-ascend 3.2 and 3.5, one :class:`Release` each, picked by the installed version; any other refused by name),
one concern per module, each asking the release: the running Triton (``runtime``), its Autotuner (``autotune``),
compile requests as data (``specialization``), the on-disk cache key (``cachekey``), and triton-ascend's own
differences (``ascend``). Callers use ``tritoncompat.<name>``: this index re-exports each module's names."""
from __future__ import annotations

from .runtime import (  # noqa: F401
    cache_dir, cache_invalidating_env_vars, cache_key_text, cache_manager_class, cache_scope, chosen_driver,
    compile_requests, get_jit_cache_hook, jit_function, kernel_ref, load_compiled, mock_tensor, preload, ptxas_path,
    restored_env, set_cache_dir, set_cache_manager, set_jit_cache_hook, start_process_warmup,
    triton_key, warmup,
)
from .releases import (  # noqa: F401
    differs_from, release, require_supported, triton_distribution, version_series,
)
from .autotune import (  # noqa: F401
    NoBenchmark, Tuning, autotuned_call, autotuner_of, can_keep_results, find_autotuner, first_tuning,
    keeps_results, pin_autotuners, tuning_of, watch_autotune_benchmarks, with_configs,
)
from .specialization import (  # noqa: F401
    Arg, INT_CLASSES, INT_DIVISIBLE, INT_ONE, INT_OTHER, Specialization, int_class, parse_specialization,
    pointer_type, read_key_dir,
)
from .cachekey import (  # noqa: F401
    ast_source, cache_key_parts, kernel_key_parts, key_dir_form, key_dir_name, on_disk, options_key_view,
)
from .ascend import (  # noqa: F401
    ASCEND_BUNDLED_COMPILER, ASCEND_FRONT_END, ASCEND_LAYOUTS, FrontEnd, ascend_ast_source, ascend_backend_dir,
    ascend_compile_on_910_95, ascend_compiler_path, ascend_front_end, ascend_install_path_in_key, ascend_key_dir,
    ascend_layout, ascend_reads_env,
)
