"""The one-GPU memory planner (lemon.run.gpuplan) and the scripts that call it before starting anything: arithmetic, the
plans for 80 GB and 141 GB cards, every refusal, the CUDA check of setup-gpu.sh, and gpu_check.sh's choice of Python."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lemon.run import gpuplan as G

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS_GIB = (15.23 + 9.98 + 19.3) * 1e9 / 2**30  # 7B bf16, 14B-AWQ, 32B-AWQ checkpoints
KV_MIN_GIB = 8192 * 2 * 2 * 128 * (28 * 4 + 48 * 8 + 64 * 8) / 2**30  # one 8192-token sequence per server, bf16 K and V


def test_needs_follow_from_the_documented_numbers():
    plan = G.plan_gpu(141)
    workers = WEIGHTS_GIB + 3 * 2.0 + KV_MIN_GIB
    assert dict(plan.needs)["resident"] == pytest.approx(workers + 34.1 + 4 * 0.75 + 4.0, abs=1e-6)
    needs = dict(G.plan_gpu(80).needs)
    bf16 = 7.656e9 * 2 / 2**30
    lora = 40.37e6 * 16 / 2**30
    act16 = 34.1 - bf16 - lora
    assert needs["microbatch"] == pytest.approx(workers + bf16 + lora + act16 / 4 + 3.0 + 4.0, abs=1e-6)
    nf4 = (1.090 * 2 + (7.656 - 1.090) * 0.516) * 1e9 / 2**30
    assert needs["4bit"] == pytest.approx(workers + nf4 + lora + act16 + 3.0 + 4.0, abs=1e-6)
    assert needs["resident"] > needs["4bit"] > needs["microbatch"]


@pytest.mark.parametrize("gib", [80, 79.2])
def test_an_80_gb_card_gets_a_micro_batch_plan_that_adds_up(gib):
    plan = G.plan_gpu(gib)
    assert plan.strategy.name == "microbatch" and plan.strategy.runnable
    assert [w.checkpoint for w in plan.workers] == ["Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-14B-Instruct-AWQ",
                                                     "Qwen/Qwen2.5-32B-Instruct-AWQ"]
    assert [w.served for w in plan.workers] == ["Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-14B-Instruct",
                                                 "Qwen/Qwen2.5-32B-Instruct"]  # configs/workers-paper.yaml
    assert all(w.kv_tokens >= G.MAX_MODEL_LEN for w in plan.workers)  # vLLM starts only then
    for w in plan.workers:  # the fraction holds weights + runtime + KV, of the WHOLE card
        assert w.util * gib == pytest.approx(w.weights_gib + G.RUNTIME_GIB + w.kv_gib, abs=1e-9)
    total = dict(plan.rows)["total (busiest phase)"]
    assert total == pytest.approx(sum(g for n, g in plan.rows[:-1]), abs=1e-9)
    assert total == pytest.approx(sum(w.util for w in plan.workers) * gib + 19.7 + 3.0, abs=0.1)
    assert plan.margin_gib >= 4.0 and plan.margin_gib == pytest.approx(gib - total)
    text = plan.table()
    assert "strategy 'microbatch'" in text and "--gpu-memory-utilization 0.21" in text and "margin left" in text
    assert "--set train.micro_batch=4" in text


@pytest.mark.parametrize("gib", [141, 139.8])
def test_a_141_gb_card_keeps_everything_resident(gib):
    plan = G.plan_gpu(gib)
    assert plan.strategy.name == "resident" and plan.strategy.sets == ()
    assert dict(plan.rows)["policy bf16 7B + LoRA, update at micro-batch 16 (peak)"] == 34.1
    assert all(60_000 < w.kv_tokens <= G.MAX_KV_TOKENS for w in plan.workers)  # the spare went to the KV caches
    assert sum(w.util for w in plan.workers) <= 1 - (34.1 + 3.0 + 4.0) / gib
    assert 4.0 <= plan.margin_gib < 8.0


@pytest.mark.parametrize("gib", [40, 70, 77.5])
def test_a_card_too_small_for_every_runnable_plan_is_refused_with_what_is_missing(gib):
    need = dict(G.plan_gpu(80).needs)["microbatch"]
    with pytest.raises(G.GPUPlanError) as e:
        G.plan_gpu(gib)
    msg = str(e.value)
    assert f"a {gib:.1f} GiB GPU holds no plan" in msg
    assert f"'microbatch', needs {need:.1f} GiB" in msg and f"{need - gib:.1f} GiB more than this card" in msg
    assert "What would fit" in msg and "only the policy on this card" in msg
    assert "'sleep' would need" in msg and "cannot sleep the workers yet" in msg


def test_sleep_plans_only_when_asked_and_never_below_their_need():
    plan = G.plan_gpu(70, runnable_only=False)
    assert plan.strategy.name == "4bit+sleep" and not plan.strategy.runnable
    assert "needs: servers with --enable-sleep-mode" in plan.table()
    assert len(plan.needs) == 5
    with pytest.raises(G.GPUPlanError, match="the smallest, '4bit\\+sleep', needs 66.2 GiB"):
        G.plan_gpu(60, runnable_only=False)


def test_bad_input_is_refused(tmp_path):
    with pytest.raises(G.GPUPlanError, match="card_gib must be > 0"):
        G.plan_gpu(0)
    with pytest.raises(G.GPUPlanError, match="unknown: \\['my/model'\\]; known: Qwen"):
        G.plan_gpu(80, checkpoints=("Qwen/Qwen2.5-7B-Instruct", "my/model", "Qwen/Qwen2.5-32B-Instruct-AWQ"))
    yaml = tmp_path / "w.yaml"
    yaml.write_text("small: {backend: openai, model: Qwen/Qwen2.5-7B-Instruct}\n")
    with pytest.raises(G.GPUPlanError, match="no model for \\['medium', 'large'\\]"):
        G.plan_gpu(80, workers=yaml)
    with pytest.raises(ValueError, match="non-negative margin"):
        G.GPUPlan(80, G.STRATEGIES[0], (), (), -1.0, ())


def test_bf16_workers_need_an_h200_and_micro_batches_there():
    bf16 = ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-14B-Instruct", "Qwen/Qwen2.5-32B-Instruct")
    assert G.plan_gpu(139.8, checkpoints=bf16).strategy.name == "microbatch"
    with pytest.raises(G.GPUPlanError, match="'microbatch', needs 139.[0-9] GiB"):
        G.plan_gpu(80, checkpoints=bf16)


def test_the_card_is_queried_and_its_absence_is_a_clear_error(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def smi(out):
        def run(cmd, **kw):
            if out is None:
                raise FileNotFoundError(2, "No such file or directory", "nvidia-smi")
            return subprocess.CompletedProcess(cmd, 0, stdout=out)
        return run
    monkeypatch.setattr(G.subprocess, "run", smi("NVIDIA H100 80GB HBM3, 81559\n"))
    gib, where = G.query_card_gib()
    assert gib == pytest.approx(79.65, abs=0.01) and where == "NVIDIA H100 80GB HBM3 (nvidia-smi)"
    monkeypatch.setattr(G.subprocess, "run", smi(None))
    with pytest.raises(G.GPUPlanError, match="no GPU to plan for: .* pass --gib N"):
        G.query_card_gib()


def test_cli_plan_gpu_prints_the_plan_and_refuses_in_one_line(capsys):
    from lemon import cli
    assert cli.main(["plan-gpu", "--gib", "141"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("card: 141.0 GiB, as given by --gib") and "strategy 'resident'" in out
    assert cli.main(["plan-gpu", "--gib", "40"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: GPUPlanError: a 40.0 GiB GPU holds no plan") and err.count("\n") == 1


def test_every_strategys_sets_apply_to_the_paper_study():
    from lemon.study.config import study_preset
    from lemon.study.profiles import parse_sets
    micro = study_preset("paper", sets=parse_sets(G.STRATEGIES[2].sets))
    assert (micro.train.micro_batch, micro.train.policy.backend, micro.sft.batch_size) == (4, "transformers", 2)
    four = study_preset("paper", sets=parse_sets(G.STRATEGIES[1].sets))
    assert four.train.policy.load_in_4bit and four.train.policy.backend == "unsloth"


def _run(cmd, cwd=ROOT, **env):
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHON": sys.executable, **env})


def test_vllm_workers_refuses_a_small_card_before_starting_anything(tmp_path):
    r = _run(["bash", "scripts/vllm_workers.sh"], LEMON_GPU_GIB="40", VLLM=str(tmp_path / "vllm"),
             LEMON_VLLM_LOGS=str(tmp_path / "logs"))
    assert r.returncode == 1 and "GPUPlanError: a 40.0 GiB GPU holds no plan" in r.stderr
    assert "refused by the GPU memory plan above; nothing started" in r.stderr and not (tmp_path / "logs").exists()
    r = _run(["bash", "scripts/vllm_workers.sh"], LEMON_GPU_GIB="80", VLLM=str(tmp_path / "vllm"))
    assert r.returncode == 1 and "strategy 'microbatch'" in r.stderr and "vllm' not found" in r.stderr  # planned first


def _fake_repo(tmp_path, script, venv):
    """tmp_path/scripts/<script> (a copy) with a fake <venv>/bin/python that prints its arguments for `-m lemon.study`
    and bench/gpu_check.py and runs this interpreter otherwise."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / script, tmp_path / "scripts" / script)
    py = tmp_path / venv / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text(f'#!/bin/sh\ncase "$*" in *lemon.study*|*gpu_check.py*) echo "RAN $*"; exit 0;; esac\n'
                  f'exec {sys.executable} "$@"\n')
    py.chmod(0o755)


def test_main_paper_refuses_a_small_card_and_applies_the_plan_otherwise(tmp_path):
    _fake_repo(tmp_path, "main.sh", ".venv-gpu")
    r = _run(["bash", "scripts/main.sh", "--profile", "paper"], cwd=tmp_path, LEMON_GPU_GIB="40")
    assert r.returncode == 1 and "RAN" not in r.stdout and "--profile paper refused by the GPU memory plan" in r.stderr
    r = _run(["bash", "scripts/main.sh", "--profile", "paper", "--set", "sft.batch_size=1"], cwd=tmp_path,
             LEMON_GPU_GIB="80")
    assert r.returncode == 0 and "GPU plan 'microbatch' adds" in r.stderr
    assert r.stdout.strip() == ("RAN -m lemon.study --set train.policy.backend=transformers --set train.micro_batch=4 "
                                "--set sft.batch_size=2 --profile paper --set sft.batch_size=1")  # the user's: last
    r = _run(["bash", "scripts/main.sh", "--profile", "paper"], cwd=tmp_path, LEMON_GPU_GIB="141")
    assert r.returncode == 0 and r.stdout.strip() == "RAN -m lemon.study --profile paper"
    r = _run(["bash", "scripts/main.sh", "--profile", "cpu"], cwd=tmp_path, LEMON_GPU_GIB="40")
    assert "GPU" not in r.stderr  # only the paper profile is planned (and runs .venv/bin/python, absent here)


def test_gpu_check_says_which_python_it_runs(tmp_path):
    _fake_repo(tmp_path, "gpu_check.sh", ".venv")
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    r = subprocess.run(["bash", "scripts/gpu_check.sh", "OUT"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60, env={**env, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("gpu_check: python .venv/bin/python (the CPU environment)")
    assert "RAN bench/gpu_check.py --out OUT" in r.stdout
    r = _run(["bash", "scripts/gpu_check.sh", "OUT"], cwd=tmp_path, PYTHON="/bin/echo")
    assert r.stdout.startswith("gpu_check: python /bin/echo ($PYTHON)")


def test_setup_gpu_refuses_an_old_driver_before_installing(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup-gpu.sh", tmp_path / "scripts")
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text('#!/bin/sh\ncase "$*" in *driver_version*) echo "570.86.15";; *) echo "GPU 0: NVIDIA H100";; esac\n')
    smi.chmod(0o755)
    r = _run(["bash", "scripts/setup-gpu.sh"], cwd=tmp_path, PATH=f"{smi.parent}:/usr/bin:/bin", PYTHON="/bin/false")
    assert r.returncode == 1 and "NVIDIA driver '570.86.15' is older than 580" in r.stderr
    assert not (tmp_path / ".venv-gpu").exists()


def test_check_cuda_fails_on_a_cpu_build_an_old_driver_and_no_device(monkeypatch):
    import torch
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(G.CudaUnusableError, match="is a CPU build"):
        G.check_cuda("580.159.04")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(G.CudaUnusableError, match="driver '570.86.15' is too old .*CUDA 13.0 needs driver >= 580"):
        G.check_cuda("570.86.15")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(G.CudaUnusableError, match="is_available\\(\\) is False \\(driver 580.159.04"):
        G.check_cuda("580.159.04")


def test_check_cuda_entry_point_exits_non_zero_here():
    import torch
    if torch.cuda.is_available():
        pytest.skip("CUDA works here")
    r = _run([sys.executable, "-m", "lemon.run.gpuplan", "--check-cuda"])
    assert r.returncode == 2 and r.stderr.startswith("error: CudaUnusableError: ")
