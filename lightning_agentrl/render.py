"""Show a trajectory as a person reads it: which text the policy wrote (mask 1) and which it saw.

Used by ``python -m lightning_agentrl inspect`` (rich, in the terminal) and for the MLflow
artifacts (HTML). Each span is decoded from the recorded ids; nothing is re-encoded.
"""

from __future__ import annotations

import html
from collections.abc import Iterator

from lightning_agentrl.trajectory import Segment, Trajectory


def spans(segment: Segment, tokenizer) -> Iterator[tuple[bool, str, list[int]]]:
    """Runs of equal mask: ``(is_action, decoded text, policy versions of the run)``."""
    start = 0
    ids, mask = segment.token_ids, segment.loss_mask
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            text = tokenizer.decode(ids[start:i], skip_special_tokens=False)
            versions = sorted({v for v in segment.policy_versions[start:i] if v >= 0})
            yield bool(mask[start]), text, versions
            start = i


def header(trajectory: Trajectory) -> str:
    versions = sorted({v for s in trajectory.segments for v in s.policy_versions if v >= 0})
    return (
        f"episode {trajectory.episode_id}  task {trajectory.task_id}  group {trajectory.group_id}  "
        f"reward {trajectory.reward:g}  termination {trajectory.termination.value if trajectory.termination else '?'}  "
        f"turns {len(trajectory.turns)}  tokens {trajectory.num_tokens} ({trajectory.num_action_tokens} trained)  "
        f"policy versions {versions}"
    )


def to_html(trajectories: list[Trajectory], tokenizer) -> str:
    parts = [
        "<html><head><meta charset='utf-8'><style>"
        "body{font-family:monospace;white-space:pre-wrap} .a{background:#d4f7d4} .o{color:#666}"
        "h3{font-family:sans-serif}</style></head><body>",
        "<p>Green: tokens the policy sampled (loss mask 1). Grey: prompt, observations, template (mask 0).</p>",
    ]
    for trajectory in trajectories:
        parts.append(f"<h3>{html.escape(header(trajectory))}</h3>")
        for k, segment in enumerate(trajectory.segments):
            if len(trajectory.segments) > 1:
                parts.append(f"<h4>segment {k}</h4>")
            for is_action, text, versions in spans(segment, tokenizer):
                title = f" title='policy version {versions}'" if is_action else ""
                parts.append(f"<span class='{'a' if is_action else 'o'}'{title}>{html.escape(text)}</span>")
    parts.append("</body></html>")
    return "".join(parts)


def print_trajectory(trajectory: Trajectory, tokenizer, console=None) -> None:
    from rich.console import Console
    from rich.text import Text

    console = console or Console()
    console.rule()
    console.print(header(trajectory), style="bold", soft_wrap=True)
    for k, segment in enumerate(trajectory.segments):
        if len(trajectory.segments) > 1:
            console.rule(f"segment {k}", style="dim")
        text = Text()
        for is_action, chunk, versions in spans(segment, tokenizer):
            if is_action:
                text.append(chunk, style="bold green")
                text.append(f"[v{','.join(map(str, versions))}]", style="magenta")
            else:
                text.append(chunk, style="dim")
        console.print(text)
