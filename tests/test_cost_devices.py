"""Device specs: the bundled figures, the loader's error messages, and the CPU calibration."""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
import socket
import time
from pathlib import Path

import pytest
import torch

from autopart.ir.errors import DeviceSpecError
from cost_models import DeviceSpec, get_cost_model, known_devices, load_device
from cost_models import calibration
from cost_models.counting import Kernel
from cost_models.devices import DEVICES_DIR, spec_name

GPUS = ["a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "mi300x"]
NVIDIA = ["a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200"]
SAME_DIE = [("a100-40gb", "a100-80gb"), ("h100-sxm", "h200")]  # one chip, more and faster memory


def test_known_devices_are_the_bundled_files() -> None:
    assert known_devices() == sorted(GPUS + ["cpu"])


@pytest.mark.parametrize("name", NVIDIA)
def test_nvidia_rates_keep_the_datasheet_s_ratios(name: str) -> None:
    """Dense tensor-core rates: TF32 half of BF16, FP16 equal to BF16, plain FP32 below TF32."""
    spec = load_device(name)
    assert spec.name == name and spec.kind == "cuda" and spec.source
    assert spec.peak_flops["tf32"] == pytest.approx(spec.peak_flops["bfloat16"] / 2, rel=0.01)
    assert spec.peak_flops["float16"] == spec.peak_flops["bfloat16"]
    assert spec.peak_flops["float32"] < spec.peak_flops["tf32"]
    assert spec.framework_overhead_bytes == 500 * 2**20


@pytest.mark.parametrize("small, large", SAME_DIE)
def test_a_larger_memory_of_the_same_chip_changes_only_memory_bound_times(small: str, large: str) -> None:
    """The roofline's answer, not the figures: the same peaks, a large matmul no slower, a
    memory-bound kernel shorter by the ratio of their bandwidths, and more memory."""
    slow, fast = get_cost_model(small), get_cost_model(large)
    assert fast.device.peak_flops == slow.device.peak_flops
    matmul = Kernel(op="aten.mm.default", category="matmul", flops=2 * 8192.0**3, bytes=3 * 8192**2 * 2, dtype="bfloat16")
    assert fast.kernel_time(matmul) <= slow.kernel_time(matmul)  # never slower (the H200's curve is measured)
    copy = Kernel(op="aten.add.Tensor", category="elementwise", flops=1e6, bytes=4e9, dtype="float32")
    ratio = slow.device.memory_bandwidth / fast.device.memory_bandwidth
    # within the few percent by which the measured memory efficiencies of the two parts differ
    assert ratio < 1 and fast.kernel_time(copy) == pytest.approx(slow.kernel_time(copy) * ratio, rel=0.08)
    assert fast.device.memory_bytes > slow.device.memory_bytes


@pytest.mark.parametrize(
    "gpu,memory,spec",
    [
        ("NVIDIA H100 80GB HBM3", 85e9, "h100-sxm"),
        ("NVIDIA H100 SXM5 80GB", 85e9, "h100-sxm"),
        ("NVIDIA H100 PCIe", 85e9, "h100-pcie"),
        ("NVIDIA H100 NVL", 100e9, "nvidia-h100-nvl"),  # no spec: not the SXM's figures
        ("NVIDIA H200", 150e9, "h200"),
        ("NVIDIA H200 NVL", 150e9, "nvidia-h200-nvl"),
        ("NVIDIA A100-SXM4-40GB", 42e9, "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", 85e9, "a100-80gb"),
        ("AMD Instinct MI300X", 206e9, "mi300x"),
    ],
)
def test_gpu_names_map_to_their_own_spec_or_none(gpu: str, memory: float, spec: str) -> None:
    assert spec_name(gpu, int(memory)) == spec
    if spec not in known_devices():
        with pytest.raises(DeviceSpecError, match="known devices: .*h100-pcie, h100-sxm, h200"):
            load_device(spec)


@pytest.mark.parametrize("name", ["a100-40gb", "a100-80gb", "h100-sxm", "h200"])
def test_nvidia_efficiencies_are_in_the_published_ranges(name: str) -> None:
    spec = load_device(name)
    # a large bf16 GEMM: sustained (Hopper's measured 0.69) to a short burst's 0.80
    assert 0.65 <= spec.matmul_efficiency_at(2 * 8192**3) <= 0.80
    assert spec.matmul_efficiency_at(2 * 256**3) < 0.15  # a small one cannot fill the GPU
    assert 0.85 <= spec.memory_efficiency <= 0.90
    # larger products fill more of the GPU; past 1e11 FLOPs Hopper's measured rate dips a little
    # below its best (0.693 at 1e12 against 0.71 at 1e11)
    efficiencies = [spec.matmul_efficiency_at(10.0**x) for x in range(5, 14)]
    assert efficiencies[:7] == sorted(efficiencies[:7])
    assert all(e >= max(efficiencies[: i + 1]) - 0.02 for i, e in enumerate(efficiencies))


def test_the_h100_sxm_multiplies_as_the_h200_measured() -> None:
    """One GH100 die, clocks and power limit: the H100's curve is the H200's measured one until an H100 is measured."""
    assert load_device("h100-sxm").matmul_efficiency == load_device("h200").matmul_efficiency
    assert load_device("h100-sxm").peak_flops == load_device("h200").peak_flops


def test_efficiency_is_piecewise_linear_in_log_flops_and_flat_beyond_the_ends() -> None:
    spec = load_device("h100-sxm")
    (x0, y0), (x1, y1) = spec.matmul_efficiency[2], spec.matmul_efficiency[3]
    assert spec.matmul_efficiency_at(10 ** ((x0 + x1) / 2)) == pytest.approx((y0 + y1) / 2)
    assert spec.matmul_efficiency_at(1.0) == spec.matmul_efficiency[0][1]
    assert spec.matmul_efficiency_at(1e20) == spec.matmul_efficiency[-1][1]


def test_unknown_device_lists_the_known_ones() -> None:
    with pytest.raises(DeviceSpecError, match=r"unknown device 'h800'; known devices: a100-40gb, .*mi300x"):
        load_device("h800")


def test_a_path_to_a_toml_file_is_a_device(tmp_path: Path) -> None:
    path = tmp_path / "my-gpu.toml"
    path.write_text((DEVICES_DIR / "h100-sxm.toml").read_text().replace('name = "h100-sxm"\n', ""))
    spec = load_device(str(path))
    assert spec.name == "my-gpu" and spec.peak_flops == load_device("h100-sxm").peak_flops


@pytest.mark.parametrize("old,new,message", [
    ("memory_bandwidth = 3.35e12", "memory_bandwidth = -1", "field 'memory_bandwidth' must be a positive number"),
    ("memory_bandwidth = 3.35e12", "memory_bandwith = 3.35e12", "field 'memory_bandwith' is not a device spec field"),
    ("kernel_overhead_s = 5e-6", "", "field 'kernel_overhead_s' is missing"),
    ("bfloat16 = 989e12", "", "field 'peak_flops' lacks bfloat16"),
    ("[11.01, 0.71]", "[8.5, 0.71]", "field 'matmul_efficiency' points must have increasing"),
    ("[12.0, 0.693]", "[12.0, 1.5]", r"field 'matmul_efficiency\[12\]' must be a fraction"),
    ('kind = "cuda"', 'kind = "tpu"', "field 'kind' must be one of cuda, rocm, cpu"),
    ("overlap_compute_slowdown = 0.19", "overlap_compute_slowdown = 1.5",
     r"field 'overlap_compute_slowdown' must be a fraction in \[0, 1\)"),
    ("memory_efficiency = 0.88", "memory_efficiency = [", "not valid TOML"),
])
def test_a_malformed_file_is_named_with_its_field(tmp_path: Path, old: str, new: str, message: str) -> None:
    text = (DEVICES_DIR / "h100-sxm.toml").read_text()
    assert old in text
    path = tmp_path / "broken.toml"
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(DeviceSpecError, match=message) as error:
        load_device(str(path))
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_a_spec_without_a_compute_slowdown_beside_collectives_assumes_none(tmp_path: Path) -> None:
    text = (DEVICES_DIR / "h100-sxm.toml").read_text()
    path = tmp_path / "older.toml"
    path.write_text("\n".join(line for line in text.splitlines() if not line.startswith("overlap_compute_slowdown")))
    assert load_device(str(path)).overlap_compute_slowdown == 0.0
    assert load_device("h100-sxm").overlap_compute_slowdown == pytest.approx(0.19)
    assert load_device("cpu").overlap_compute_slowdown == 0.0  # its reductions' share of the cores is measured
    # what the step model and the search charge: the figure where collectives run beside the compute
    assert load_device("h100-sxm").slowdown_beside_collectives == pytest.approx(0.19)
    cpu = dataclasses.replace(load_device("a100-80gb"), kind="cpu")
    assert cpu.overlap_compute_slowdown > 0 and cpu.slowdown_beside_collectives == 0.0


def test_missing_toml_path_is_a_device_spec_error(tmp_path: Path) -> None:
    with pytest.raises(DeviceSpecError, match="does not exist"):
        load_device(str(tmp_path / "nowhere.toml"))


def test_spec_is_frozen_and_validated_on_construction() -> None:
    spec = load_device("a100-80gb")
    with pytest.raises(AttributeError):
        spec.memory_bytes = 1  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert dataclasses.asdict(spec)["peak_flops"]["bfloat16"] == 312e12
    assert hash(spec) == hash(load_device("a100-80gb"))
    fields = {name: getattr(spec, name) for name in DeviceSpec.__dataclass_fields__}
    with pytest.raises(DeviceSpecError, match="link_efficiency"):
        DeviceSpec(**{**fields, "link_efficiency": 0.0})


# --- the CPU, calibrated -----------------------------------------------------------------------

@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_cpu_is_calibrated_once_then_read_from_the_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = load_device("cpu")
    files = list(cache.glob("cpu-*.json"))
    assert len(files) == 1
    name = files[0].name
    assert socket.gethostname().split(".")[0] in name and f"threads{torch.get_num_threads()}" in name
    assert torch.__version__.split("+")[0] in name
    recorded = json.loads(files[0].read_text())
    assert recorded["seconds_spent"] < 5

    assert spec.kind == "cpu" and spec.memory_bytes == calibration.physical_memory_bytes()
    assert spec.framework_overhead_bytes < load_device("h100-sxm").framework_overhead_bytes
    assert len(spec.matmul_efficiency) == len(calibration.MATMUL_SIZES)  # a measured curve
    assert max(y for _, y in spec.matmul_efficiency) == 1.0  # the peak is the best measured rate
    assert 1e8 < spec.peak_flops["float32"] < 1e13
    assert 1e8 < spec.memory_bandwidth < 1e12
    assert 0 < spec.kernel_overhead_s < 1e-3

    def no_measuring(**_: object) -> None:
        raise AssertionError("measured again instead of reading the cache")

    monkeypatch.setattr(calibration, "_measure", no_measuring)
    assert load_device("cpu") == spec


def test_a_corrupt_or_foreign_cache_is_measured_again(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    measured: list[str] = []

    def measure(*, host: str, threads: int) -> calibration.CpuCalibration:
        measured.append(host)
        return calibration.CpuCalibration(
            host=host, torch_version=torch.__version__, threads=threads,
            matmul_rates=((1e6, 1e9), (1e9, 5e10)), copy_bandwidth=1e10, kernel_overhead_s=5e-6,
            seconds_spent=0.0)

    monkeypatch.setattr(calibration, "_measure", measure)
    first = calibration.calibrate_cpu()
    assert calibration.calibrate_cpu() == first and len(measured) == 1
    path = next(cache.glob("cpu-*.json"))
    path.write_text("{not json")
    assert calibration.calibrate_cpu() == first and len(measured) == 2
    path.write_text(path.read_text().replace(f'"threads": {first.threads}', '"threads": 999'))
    assert calibration.calibrate_cpu() == first and len(measured) == 3
    assert json.loads(path.read_text())["threads"] == first.threads


def test_calibrated_file_must_not_state_measured_fields(tmp_path: Path) -> None:
    path = tmp_path / "box.toml"
    path.write_text((DEVICES_DIR / "cpu.toml").read_text() + "memory_bytes = 1024\n")
    with pytest.raises(DeviceSpecError, match="field 'memory_bytes' is measured when calibrate = true"):
        load_device(str(path))


def test_cpu_template_filled_by_hand_needs_no_calibration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calibration, "_measure", lambda **_: math.nan)
    text = (DEVICES_DIR / "cpu.toml").read_text().replace("calibrate = true", "calibrate = false")
    text = text.replace('fp32_matmul_uses_tf32 = false', "\n".join([
        "fp32_matmul_uses_tf32 = false", "memory_bytes = 68_719_476_736",
        "memory_bandwidth = 20e9", "kernel_overhead_s = 4e-6",
        "matmul_efficiency = [[6.0, 0.2], [9.0, 0.9]]",
        "peak_flops = { float32 = 1e12, tf32 = 1e12, bfloat16 = 2e12, float16 = 2e12 }"]))
    path = tmp_path / "workstation.toml"
    path.write_text(text)
    spec = load_device(str(path))
    assert spec.name == "cpu" and spec.peak_flops["bfloat16"] == 2e12


def test_background_load_counts_the_busy_processes_beside_it_in_whole_processes() -> None:
    """Two processes spinning all through the count are runnable at every sample of it: at least
    two, whatever else runs. (Not two more than a count before or after: the others' load moves
    between the counts by more than that on a shared machine.)"""
    import subprocess
    import sys

    spin = [sys.executable, "-c", "import time\nend = time.time() + 20\nprint(flush=True)\nwhile time.time() < end: pass"]
    busy = [subprocess.Popen(spin, stdout=subprocess.PIPE) for _ in range(2)]
    try:
        for process in busy:
            process.stdout.readline()  # spinning from here on, however long it took to start
        during = calibration.background_load(2)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert during == int(during) and during >= 2


def test_background_load_without_procfs_is_inferred_from_a_threads_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``L`` others on ``C`` cores one busy thread gets ``C / (L + 1)`` of a core; the thread's
    clock is injected, so the figure does not depend on who else runs here."""
    monkeypatch.setattr(calibration, "_runnable_others", lambda seconds: None)
    for share, others in ((1.0, 0.0), (0.5, 3.0), (2 / 3, 2.0)):
        monkeypatch.setattr(calibration.time, "thread_time", lambda share=share: time.perf_counter() * share)
        assert calibration.background_load(2, seconds=0.05) == others
    monkeypatch.setattr(calibration, "_others_from_share", lambda cores, seconds: 1.4)  # noise on a share
    assert calibration.background_load(2) == 1.0


@pytest.mark.parametrize("edit", [{"copy_bandwidth": -1.0}, {"copy_bandwidth": float("nan")}, {"matmul_rates": []},
                                  {"matmul_rates": [[1e6, float("inf")]]}, {"matmul_rates": [[1e6]]},
                                  {"kernel_overhead_s": "fast"}])
def test_a_cached_calibration_of_figures_no_measurement_gives_is_measured_again(
        cache: Path, monkeypatch: pytest.MonkeyPatch, edit: dict) -> None:
    """A cache edited by hand to NaN or a negative bandwidth failed every compile for the CPU with
    'cpu.toml: field peak_flops.float32 must be a positive number, got nan; fix the file', a file
    that was fine."""
    measured: list[str] = []

    def measure(*, host: str, threads: int) -> calibration.CpuCalibration:
        measured.append(host)
        return calibration.CpuCalibration(
            host=host, torch_version=torch.__version__, threads=threads,
            matmul_rates=((1e6, 1e9), (1e9, 5e10)), copy_bandwidth=1e10, kernel_overhead_s=5e-6, seconds_spent=0.0)

    monkeypatch.setattr(calibration, "_measure", measure)
    first = calibration.calibrate_cpu()
    path = next(cache.glob("cpu-*.json"))
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    assert calibration.calibrate_cpu() == first and len(measured) == 2
