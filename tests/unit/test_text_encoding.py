"""Text files are read and written as UTF-8 whatever the locale: a server under zh_CN.GB18030 (or
LC_ALL=C with Python's UTF-8 mode off) wrote config.toml in its own encoding, which the reader,
strict about UTF-8, then refused on resume; and read a UTF-8 tokenizer_config.json as no settings,
so the model's chat template was dropped for ChatML in silence."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "shardline"


COMPRESSED = ("gzip", "bz2", "lzma")  # their open() is binary unless the mode says "t"


def _text_open(node: ast.Call, position: int, default_text: bool) -> bool:
    """An open call whose mode (argument `position`, or mode=) opens text."""
    modes = [a.value for a in node.args[position:position + 1] if isinstance(a, ast.Constant)]
    modes += [k.value.value for k in node.keywords if k.arg == "mode" and isinstance(k.value, ast.Constant)]
    if not modes:
        return default_text and len(node.args) <= position  # (a mode given as a name: not judged)
    return "t" in modes[0] if not default_text else "b" not in modes[0]


def _unencoded_calls(tree: ast.AST) -> list[int]:
    """Lines of read_text/write_text calls, and of text-mode open() (built-in, io's, os.fdopen, a Path's,
    gzip's/bz2's/lzma's), without encoding=."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or any(k.arg == "encoding" for k in node.keywords):
            continue
        f = node.func
        owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
        if isinstance(f, ast.Attribute) and f.attr in ("read_text", "write_text"):
            text = True
        elif (isinstance(f, ast.Name) and f.id == "open") or (isinstance(f, ast.Attribute) and f.attr == "fdopen"):
            text = _text_open(node, 1, default_text=True)
        elif isinstance(f, ast.Attribute) and f.attr == "open" and owner != "os":  # (os.open: flags, a descriptor)
            text = _text_open(node, 1 if owner in ("io", *COMPRESSED) else 0, default_text=owner not in COMPRESSED)
        else:
            text = False
        if text:
            found.append(node.lineno)
    return found


def test_the_scan_finds_each_kind_of_text_open():
    """The scan below can fail: each way of opening text without an encoding is found, binary and
    encoded ones are not (a method named open taking other arguments is not judged)."""
    code = ["p.open('w')", "io.open(f)", "gzip.open(f, 'rt')", "open(f)", "os.fdopen(fd, 'w')", "p.read_text()",
            "p.open()", "gzip.open(f)", "os.open(f, 1)", "p.open('rb')", "open(f, 'rb')", "p.open('w', encoding='u')",
            "guard.open(run_dir, log)", "lzma.open(f, mode='rb')"]
    assert _unencoded_calls(ast.parse("\n".join(code))) == [1, 2, 3, 4, 5, 6, 7]


def test_every_text_file_the_package_reads_or_writes_names_its_encoding():
    missing = {str(p.relative_to(SRC)): lines for p in sorted(SRC.rglob("*.py"))
               if (lines := _unencoded_calls(ast.parse(p.read_text(encoding="utf-8"))))}
    assert not missing, f"text read or written in the locale's encoding (give encoding=\"utf-8\"): {missing}"


def test_a_non_utf8_locale_reads_the_chat_template_and_round_trips_the_config(tmp_path):
    """Under LC_ALL=C with UTF-8 mode off (Python's default text encoding ASCII), as under GB18030:
    non-ASCII text in the files (the paths stay ASCII: such a locale cannot name others)."""
    eos = "‹｜end▁of▁sentence｜>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}‹｜{{ m.role }}｜>{{ m.content }}{% endfor %}", "eos_token": eos},
        ensure_ascii=False), encoding="utf-8")
    config, data = tmp_path / "config.toml", "语料.txt"
    script = tmp_path / "check.py"
    script.write_text(  # (the script itself ASCII: its non-ASCII strings escaped)
        "import locale\n"
        "from shardline.config import load_config, save_config\n"
        "from shardline.data.chat_template import chat_template_for\n"
        f"t = chat_template_for({ascii(str(tmp_path / 'tokenizer.json'))})\n"
        f"assert t is not None and t.eos_token == {ascii(eos)}, t\n"
        f"save_config(load_config(None, [{ascii('data.path=' + data)}]), {ascii(str(config))})\n"
        f"assert load_config({ascii(str(config))}, []).data.path == {ascii(data)}\n"
        "print(locale.getpreferredencoding(False))\n", encoding="ascii")
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, encoding="utf-8",
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1].lower() in ("ascii", "ansi_x3.4-1968"), done.stdout  # (the locale really was C)
    assert data in config.read_text(encoding="utf-8")
