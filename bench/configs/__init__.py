"""The model configs the benchmarks plan for (`README.md` says where each comes from)."""

from pathlib import Path

CONFIG_DIR = Path(__file__).parent
