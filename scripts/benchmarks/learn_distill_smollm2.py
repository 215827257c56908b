"""On-policy distillation of a real model on a CPU: SmolLM2-135M-Instruct distilled from a SmolLM2-135M-Instruct
checkpoint that GRPO trained on the arithmetic preset, the teacher served by ``ref_client.py``.

    python scripts/benchmarks/learn_distill_smollm2.py                     # teacher (if missing), then the student
    python scripts/benchmarks/learn_distill_smollm2.py --teacher DIR [key=value ...]

1. The teacher: scripts/benchmarks/learn_smollm2.py's run (configs/smollm2_arith.yaml, GRPO with its reference
   server, seed 0), unless ``--teacher`` names an HF folder or ``OUT/teacher/seed-0/final`` exists.
2. The teacher served: ``python ref_client.py --config configs/smollm2_arith.yaml ref.model=TEACHER``.
3. The student: the same config with ``algo.name=opd``, ``teacher.url`` at that server, no reference (beta 0), the
   math reward scored and logged only; held-out greedy accuracy on the same 200 problems at steps 0, 24, 48, 72.

Prints and writes OUT/summary.md: the student's accuracy before and after, the teacher's, the problems fixed and
broken, the reverse KL to the teacher, steps and wall time.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import learn_smollm2 as base  # noqa: E402  (its ROOT is on sys.path after this import)
from grpo.reference.launch import ServerProcess, free_port  # noqa: E402
from grpo.training.metrics import read_metrics  # noqa: E402

ROOT = base.ROOT


def distil(teacher: Path, config: str, out: Path, seed: int, threads: int, overrides: list[str]) -> float:
    """The student's run against ``teacher`` on its own ref_client.py server; returns its wall time."""
    out.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(["--config", config, f"ref.model={teacher}"], port=free_port(),
                           log_path=out / "teacher_server.log", env={"OMP_NUM_THREADS": str(threads)})
    print(f"$ python ref_client.py --config {config} ref.model={teacher} --port {server.port}", flush=True)
    server.start(timeout=300)
    try:
        walls = base.train([seed], config, out, threads, ["algo.name=opd", "algo.beta=0", "ref.url=null",
                                                          f"teacher.url={server.url}", *overrides])
    finally:
        print(f"teacher server stopped (exit {server.stop()})", flush=True)
    return walls[seed]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/smollm2_arith.yaml")
    p.add_argument("--teacher", type=Path, help="an HF folder (default: train one, or reuse OUT/teacher)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "distill_smollm2")
    p.add_argument("overrides", nargs="*", help="key=value overrides for the student's run")
    args = p.parse_args()

    model = ROOT / "models" / "smollm2-135m-instruct"
    if not (model / "model.safetensors").is_file():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "fetch_smollm2.py")], check=True)
    teacher, teacher_wall = args.teacher, None
    if teacher is None:
        teacher = args.out / "teacher" / "seed-0" / "final"
        if not (teacher / "config.json").is_file():
            t0 = time.time()
            base.train_with_reference([0], args.config, args.out / "teacher", args.threads, [])
            teacher_wall = time.time() - t0
    wall = distil(teacher, args.config, args.out / "student", args.seed, args.threads, args.overrides)
    student = base.summarize(args.out / "student" / f"seed-{args.seed}")
    rows = read_metrics(args.out / "student" / f"seed-{args.seed}" / "metrics.jsonl")
    kl = [r["distill/reverse_kl"] for r in rows if "distill/reverse_kl" in r]
    k = max(1, len(kl) // 5)
    taught = base.summarize(args.out / "teacher" / "seed-0") if args.teacher is None else None
    lines = ["| run | steps | held-out accuracy (greedy, 200 problems) | fixed / broken (sign test p) | "
             "train reward, first -> last 20% | reverse KL to the teacher, first -> last 20% | wall time |",
             "|---|---|---|---|---|---|---|"]
    if taught is not None:
        lines.append(f"| teacher: GRPO (the preset) | {taught['steps']} | {taught['before']:.3f} -> {taught['after']:.3f} | "
                     f"{taught['fixed']} / {taught['broken']} ({taught['p']:.1e}) | {taught['reward_first']:.3f} -> "
                     f"{taught['reward_last']:.3f} | | "
                     f"{f'{teacher_wall / 60:.0f} min' if teacher_wall else 'reused'} |")
    lines.append(f"| student: opd from the served teacher, no reward in its advantage | {student['steps']} | "
                 f"{student['before']:.3f} -> {student['after']:.3f} | {student['fixed']} / {student['broken']} "
                 f"({student['p']:.1e}) | {student['reward_first']:.3f} -> {student['reward_last']:.3f} | "
                 f"{sum(kl[:k]) / k:.3f} -> {sum(kl[-k:]) / k:.3f} | {wall / 60:.0f} min |")
    if taught is not None:
        gap = taught["after"] - student["before"]
        moved = (student["after"] - student["before"]) / gap if gap > 0 else float("nan")
        lines += ["", f"The student closed {100 * moved:.0f}% of the gap between its start ({student['before']:.3f}) and "
                      f"the teacher ({taught['after']:.3f})."]
    text = "\n".join(lines)
    print(text)
    (args.out / "summary.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
