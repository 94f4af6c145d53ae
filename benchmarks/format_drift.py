"""Where a broken tool call comes from, in a `make learn` run: the tokens the warm start would never
write that a later policy writes, and whether the token's output row or the hidden state under it moved.

    python benchmarks/format_drift.py runs/learn_cpu-20261202-124230 --before 40 --after 50 --step 51

For each episode of training step ``--step`` (its saved trajectories) that did not submit, it takes
the first action token that the warm start gives less than 1% and the ``--after`` snapshot more than
5%. It prints the context, the token's probability under the warm start and both snapshots, and
splits the change of its logit from ``--before`` to ``--after`` (h: the last hidden state, W: the
output matrix):

    row     (W_after[y] - W_before[y]) . h_after      the token's output row moved
    hidden  W_before[y] . (h_after - h_before)        the hidden state under it moved

and the same for the warm start's most likely token at that position. ``--out`` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lightning_agentrl.trajectory import TerminationReason, load_trajectories  # noqa: E402

NEVER, NOW = 0.01, 0.05  # "the warm start would never write it", "the later policy does"


def _load(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def _hidden_and_probs(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(ids[None], output_hidden_states=True)
    return out.hidden_states[-1][0], out.logits[0].float().softmax(-1)


def _split(token: int, *, p_warm, p_old, p_new, h_old, h_new, w_old, w_new) -> dict:
    """One token at one position: its probabilities, and its logit change split into row and hidden."""
    return {"p_warm_start": float(p_warm[token]), "p_before": float(p_old[token]), "p_after": float(p_new[token]),
            "row": float((w_new[token] - w_old[token]) @ h_new), "hidden": float(w_old[token] @ (h_new - h_old))}


def drift_rows(run_dir: Path, before: int, after: int, step: int, limit: int) -> list[dict]:
    """One row per failed episode of ``step`` that holds such a token (at most ``limit``)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run_dir / "warm_start")
    warm, old, new = (_load(run_dir / "warm_start"), _load(run_dir / "snapshots" / f"step_{before:06d}"),
                      _load(run_dir / "snapshots" / f"step_{after:06d}"))
    w_old, w_new = old.get_output_embeddings().weight.detach(), new.get_output_embeddings().weight.detach()
    rows, seen = [], set()
    for trajectory in load_trajectories(run_dir / "trajectories" / f"step_{step:06d}.jsonl"):
        if trajectory.termination is TerminationReason.SUBMITTED or len(rows) >= limit:
            continue
        segment = trajectory.segments[0]
        ids = torch.tensor(segment.token_ids)
        (_, p_warm), (h_old, p_old), (h_new, p_new) = (_hidden_and_probs(m, ids) for m in (warm, old, new))
        for i in range(1, len(ids)):
            y = int(ids[i])
            if not segment.loss_mask[i] or p_warm[i - 1, y] >= NEVER or p_new[i - 1, y] <= NOW:
                continue
            key = tuple(segment.token_ids[: i + 1])
            if key in seen:
                break  # the same prefix and token as an episode already listed (episodes of a group often are)
            seen.add(key)
            at = {"p_warm": p_warm[i - 1], "p_old": p_old[i - 1], "p_new": p_new[i - 1], "h_old": h_old[i - 1],
                  "h_new": h_new[i - 1], "w_old": w_old, "w_new": w_new}
            rows.append({"episode": trajectory.episode_id, "position": i,
                         "context": tokenizer.decode(ids[max(0, i - 12):i]),
                         "written": {"token": tokenizer.decode([y]), **_split(y, **at)},
                         "warm_start_top": {"token": tokenizer.decode([top := int(p_warm[i - 1].argmax())]),
                                            **_split(top, **at)}})
            break
    return rows


def missing_inputs(run_dir: Path, before: int, after: int, step: int) -> str | None:
    """What the run lacks for these steps (a message naming the snapshots it has), or None."""
    needed = [run_dir / "warm_start", run_dir / "snapshots" / f"step_{before:06d}",
              run_dir / "snapshots" / f"step_{after:06d}", run_dir / "trajectories" / f"step_{step:06d}.jsonl"]
    absent = [str(path) for path in needed if not path.exists()]
    if not absent:
        return None
    have = sorted(int(p.name.split("_")[1]) for p in (run_dir / "snapshots").glob("step_*")) if run_dir.is_dir() else []
    return (f"not found: {', '.join(absent)}. A `make learn` run folder (benchmarks/learn_cpu.py --run-dir) has "
            f"warm_start/, snapshots/step_NNNNNN and trajectories/; this one has snapshots at steps {have or 'none'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--before", type=int, required=True, help="snapshot step before the break")
    parser.add_argument("--after", type=int, required=True, help="snapshot step after it")
    parser.add_argument("--step", type=int, default=None, help="training step whose episodes to read (default --after)")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    step = args.after if args.step is None else args.step
    problem = missing_inputs(args.run_dir, args.before, args.after, step)
    if problem is not None:
        print(f"format_drift: {problem}", file=sys.stderr)
        return 2
    rows = drift_rows(args.run_dir, args.before, args.after, step, args.limit)
    if not rows:
        print(f"format_drift: no episode of step {step} that did not submit holds a token under {NEVER:.0%} for the "
              f"warm start and over {NOW:.0%} at step {args.after}", file=sys.stderr)
    for row in rows:
        w, t = row["written"], row["warm_start_top"]
        print(f"{row['episode']} ...{row['context']!r} -> {w['token']!r}: p {w['p_warm_start']:.4f} (warm start) "
              f"{w['p_before']:.3f} -> {w['p_after']:.3f}, logit change row {w['row']:+.2f} hidden {w['hidden']:+.2f}; "
              f"warm start's {t['token']!r}: {t['p_before']:.3f} -> {t['p_after']:.3f}, row {t['row']:+.2f} "
              f"hidden {t['hidden']:+.2f}")
    if args.out is not None:
        args.out.write_text(json.dumps({"run_dir": str(args.run_dir), "before": args.before, "after": args.after,
                                        "rows": rows}, indent=1) + "\n")
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
