import sys
from pathlib import Path

answer = Path("answer.txt").read_text(encoding="utf-8").strip() if Path("answer.txt").exists() else ""
sys.exit(0 if answer == '3' else 1)
