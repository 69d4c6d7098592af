"""What the docs tell users to type: every install command keeps the CPU torch (issue 49.4)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# what pulls torch in: trainfast itself (an editable install or the package), and timm
PULLS_TORCH = re.compile(r"(-e\s+['\"]?\.|(^|\s)['\"]?trainfast\b|(^|\s)timm\b)")


def _install_commands():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*")),
             *sorted((ROOT / "benchmarks").glob("*.py")), *sorted((ROOT / "trainfast").rglob("*.py"))]
    for path in files:
        if not path.is_file():
            continue
        text = re.sub(r"\s*\n\s*", " ", path.read_text(encoding="utf-8"))  # commands folded over lines
        for m in re.finditer(r"pip install ([^`\n)]*)", text):
            yield path.relative_to(ROOT), m.group(1).split("&&")[0].split(" #")[0]


def test_the_docs_have_install_commands_to_check():
    assert sum(1 for _ in _install_commands()) >= 10


def test_every_documented_install_that_brings_torch_pins_it():
    unpinned = [f"{path}: pip install {args}" for path, args in _install_commands()
                if PULLS_TORCH.search(args) and "torch==" not in args
                and "[gpu]" not in args  # the GPU extra is for a CUDA torch the user chose
                and args.strip() != "-e ."]  # "keeps the torch you have", as the README says beside it
    assert not unpinned, "\n".join(unpinned)
