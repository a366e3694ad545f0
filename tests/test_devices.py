"""Device profiles: inside a plan or build process torch.cuda's and Triton's device queries answer as the
manifest's device; every other process (a node, `prewarm record`'s children, verify) is left as it was."""
from __future__ import annotations

import json
import os
from pathlib import Path
import subprocess
import sys
from dataclasses import fields

import pytest

from prewarm import devices

from prewarm.planning import plan
from prewarm.errors import ManifestError
from prewarm.planning.manifest import load

QUERIES = """
import json, torch, triton
p = torch.cuda.get_device_properties(0)
print(json.dumps({
    "available": torch.cuda.is_available(), "count": torch.cuda.device_count(),
    "current": torch.cuda.current_device() if torch.cuda.is_available() else None,
    "name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    "capability": list(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None,
    "optin": p.shared_memory_per_block_optin, "sms": p.multi_processor_count, "l2": p.L2_cache_size,
    "triton": triton.runtime.driver.active.utils.get_device_properties(0),
}))
"""


def run(prelude: str) -> dict:
    done = subprocess.run([sys.executable, "-c", prelude + QUERIES], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_build_process_answers_every_device_query_as_the_h200():
    """As the real H200 answered on the device machine (bench/results/h200_properties.json, devices.MEASURE_COMMAND)."""
    real = json.loads((Path(__file__).resolve().parents[1] / "bench" / "results" / "h200_properties.json").read_text())
    seen = run("from prewarm.building.backends import get_target; get_target('cuda', 'sm_90', 'offline', 'H200').activate()\n")
    t = real["torch"]
    assert seen == {
        "available": True, "count": 1, "current": 0, "name": t["name"], "capability": real["capability"],
        "optin": t["shared_memory_per_block_optin"], "sms": t["multi_processor_count"], "l2": t["L2_cache_size"],
        "triton": real["triton"],
    }  # fmt: skip


def test_other_processes_see_the_real_machine_even_with_every_prewarm_module_imported():
    done = subprocess.run([sys.executable, "-c", (
        "import torch, prewarm.cli, prewarm.planning.plan, prewarm.building.build, prewarm.planning.record, prewarm.devices, prewarm.building.backends\n"
        "print(torch.cuda.is_available(), torch.cuda.get_device_name.__module__)")],
        capture_output=True, text=True)  # fmt: skip
    assert done.stdout.split() == ["False", "torch.cuda"], done.stderr[-2000:]


def test_deactivate_puts_torch_back():
    import torch
    from triton.runtime.driver import driver

    from prewarm.building.backends import CudaOfflineTarget

    saved, original = driver._active, torch.cuda.get_device_name
    try:
        CudaOfflineTarget("cuda", "sm_100", "B200").activate()
        assert torch.cuda.get_device_capability() == (10, 0) and torch.cuda.is_available()
        assert driver.active.utils.get_device_properties(0)["multiprocessor_count"] == 148
    finally:
        devices.deactivate()
        driver._active = saved  # reset_active() would probe for a GPU: put back exactly what was there
    assert torch.cuda.get_device_name is original and devices.active() is None


def test_activating_without_a_target_only_driver_is_refused():
    from triton.runtime.driver import driver

    saved = driver._active
    driver._active = None
    try:
        with pytest.raises(RuntimeError, match="target-only driver"):
            devices.activate(devices.PROFILES["H200"])
    finally:
        driver._active = saved


@pytest.mark.parametrize("name", sorted(devices.PROFILES))
def test_every_figure_says_where_it_comes_from(name):
    profile = devices.PROFILES[name]
    figures = [f.name for f in fields(profile) if f.name not in ("sources", "backend")
               and getattr(profile, f.name) not in (0, (0, 0), "")]  # fmt: skip
    missing = [f for f in figures if not profile.sources.get(f, "").startswith(("measured:", "documented:",
                                                                                "unverified:"))]
    assert not missing, f"{name}: figures without a source: {missing}"


def manifest_with(tmp_path, target: str):
    path = tmp_path / "m.toml"
    path.write_text(f"[target]\n{target}\n[spec.model]\nkda_heads = 4\nhead_k_dim = 64\nhead_v_dim = 64\n"
                    f"[[kernels]]\nprovider = \"prewarm_kernels.kda.serving\"\n")  # fmt: skip
    return load(path)


def test_the_manifest_names_the_profile_by_name_or_alias(tmp_path):
    assert plan.manifest_device(manifest_with(tmp_path, 'backend = "cuda"\narch = "sm_90"\ndevice = "H200"')) \
        == "H200"
    assert plan.manifest_device(manifest_with(
        tmp_path, 'backend = "npu"\narch = "Ascend910_9391"\ndevice = "A3"')) == "Ascend910_93"
    assert plan.manifest_device(manifest_with(tmp_path, 'backend = "cuda"\narch = "sm_90"')) is None


def test_an_unknown_device_or_one_of_another_arch_is_a_manifest_error(tmp_path):
    with pytest.raises(ManifestError, match=r"m\.toml: target: device = 'H300': expected one of .*H200"):
        plan.manifest_device(manifest_with(tmp_path, 'backend = "cuda"\narch = "sm_90"\ndevice = "H300"'))
    with pytest.raises(ManifestError, match=r"target\.device = 'A100': that device is cuda sm_80, but the manifest "
                                            r"targets cuda sm_90"):
        plan.manifest_device(manifest_with(tmp_path, 'backend = "cuda"\narch = "sm_90"\ndevice = "A100"'))


def test_an_ascend_plan_process_answers_the_a3s_core_counts_through_triton_ascends_driver():
    """triton-ascend 3.2 (its own env): the target-only NPU driver answers as the A3; torch.cuda is untouched."""
    from prewarm_helpers import REPO

    python = REPO / ".venv-ascend" / "bin" / "python"
    if not python.exists():
        pytest.skip("no .venv-ascend here (bash .ci/setup makes it)")
    code = ("import json, torch\nfrom prewarm.building.backends.npu import activate_offline\n"
            "activate_offline('Ascend910_9391', 'A3')\n"
            "from triton.runtime.driver import driver\n"
            "print(json.dumps([driver.active.utils.get_device_properties(0), torch.cuda.is_available()]))")
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [
        {"max_shared_mem": 1, "num_aicore": 24, "num_vectorcore": 48}, False]


def test_plan_itself_activates_nothing_a_planning_process_activates_the_profile_first(tmp_path):
    """plan() leaves torch.cuda and Triton's driver alone even where the manifest names a device; the plan CLI's
    backends.activate_for_planning (no GPU here) is what makes this process answer as that device."""
    from prewarm_helpers import REPO

    text = (REPO / "manifests" / "kimi-linear-h200.toml").read_text()
    manifest = tmp_path / "m.toml"
    assert '\ndevice = "H200"' in text  # the shipped manifest names its device (its autotune table's rows' key)
    manifest.write_text(text)
    code = ("import json, sys, torch\nfrom prewarm.building import backends, tritoncompat\nfrom prewarm.planning.manifest import load\n"
            "from prewarm.planning.plan import plan\n"
            "def seen(): return [tritoncompat.chosen_driver() is not None, torch.cuda.get_device_name.__module__]\n"
            f"m = load({str(manifest)!r})\nplanned = len(plan(m).requests)\nbefore = seen()\n"
            "backends.activate_for_planning(m)\nprint(json.dumps([planned, before, seen()]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    planned, before, after = json.loads(done.stdout.splitlines()[-1])
    assert planned > 0 and before == [False, "torch.cuda"] and after == [True, "prewarm.devices"]


DRIVER_QUERIES = """
import ctypes, json
from prewarm.building.backends import cuda
cuda.activate_offline("sm_90", "H200")
libcuda = ctypes.CDLL("libcuda.so.1")  # what a server's extension needs (sgl_kernel, vllm._C: NEEDED libcuda.so.1)
nvml = ctypes.CDLL("libnvidia-ml.so.1")
count, major, minor, handle = ctypes.c_uint(), ctypes.c_int(), ctypes.c_int(), ctypes.c_void_p()
name = ctypes.create_string_buffer(96)
print(json.dumps({
    "cuInit": libcuda.cuInit(0), "cuPointerGetAttribute": libcuda.cuPointerGetAttribute(0, 0, 0),
    "nvmlInit": nvml.nvmlInit_v2(), "count": (nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)), count.value),
    "handle": nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)),
    "capability": nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)),
    "cc": [major.value, minor.value], "name": (nvml.nvmlDeviceGetName(handle, name, 96), name.value.decode()),
}))
"""


DRIVER_INSTALLED = subprocess.run([sys.executable, "-c", "import ctypes; ctypes.CDLL('libcuda.so.1')"],
                                  capture_output=True).returncode == 0
no_driver = pytest.mark.skipif(DRIVER_INSTALLED, reason="the NVIDIA driver is installed here: the profile leaves it")


@no_driver
def test_a_plan_process_without_the_driver_loads_what_links_it_and_nvml_names_the_profile(tmp_path):
    """A server's extensions link libcuda.so.1 and vLLM picks its platform through NVML: under a CUDA profile both
    load in the plan process (the driver's entry points answer no device; NVML answers as the H200), and nowhere
    else (a fresh process still has no libcuda)."""
    done = subprocess.run([sys.executable, "-c", DRIVER_QUERIES], capture_output=True, text=True,
                          env={**os.environ, "CUDA_HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got == {"cuInit": devices.CUDA_ERROR_NO_DEVICE, "cuPointerGetAttribute": devices.CUDA_ERROR_NO_DEVICE,
                   "nvmlInit": 0, "count": [0, 1], "handle": 0, "capability": 0, "cc": [9, 0],
                   "name": [0, "NVIDIA H200"]}
    assert subprocess.run([sys.executable, "-c", "import ctypes; ctypes.CDLL('libcuda.so.1')"],
                          capture_output=True).returncode != 0


def test_the_driver_stand_in_exports_every_entry_point_the_header_declares_under_its_exported_names():
    import triton.backends.nvidia

    names = devices.driver_entry_points(Path(triton.backends.nvidia.__file__).parent / "include" / "cuda.h")
    # as sgl_kernel's common_ops and spatial_ops reference them (nm -D --undefined-only)
    assert {"cuGetProcAddress_v2", "cuPointerGetAttribute", "cuCtxPushCurrent_v2", "cuGreenCtxCreate",
            "cuMemcpyHtoD_v2", "cuMemcpyHtoD_v2_ptds", "cuInit"} <= set(names)


@no_driver
def test_a_server_import_that_needs_a_library_the_profile_cannot_provide_is_exit_11_naming_the_import(tmp_path):
    """No driver, no CUDA stub and no C compiler: the profile cannot stand in for libcuda.so.1, and the server whose
    import needs it is named with the fix (an environment problem, not a manifest error)."""
    (tmp_path / "server_ext.py").write_text("import ctypes\nctypes.CDLL('libcuda.so.1')\n")
    (tmp_path / "needs_driver.py").write_text(
        "def launches(spec):\n    import server_ext  # noqa: F401\n    return []\n")
    manifest = tmp_path / "m.toml"
    manifest.write_text('name = "m"\n[target]\nbackend = "cuda"\narch = "sm_90"\ndevice = "H200"\n'
                        '[[kernels]]\nprovider = "needs_driver"\n')
    done = subprocess.run([sys.executable, "-m", "prewarm.cli", "plan", str(manifest)], capture_output=True,
                          text=True, env={**os.environ, "CC": "/nonexistent/cc", "CUDA_HOME": str(tmp_path),
                                          "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])})
    assert done.returncode == 11, done.stderr[-2000:]
    assert "import server_ext" in done.stderr and "libcuda.so.1 could not be loaded" in done.stderr
    assert "/nonexistent/cc" in done.stderr and "fix: install a C compiler" in done.stderr
