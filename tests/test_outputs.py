"""One way out (`ssogvit.outputs`): one writer (atomic, never replacing a file unasked, umask honoured), outputs
checked before any work, temporary names that are recognisably ours. The rules for a folder a command owns are
tests/test_run_folder.py."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ssogvit.outputs import (
    OutputError,
    OutputExistsError,
    atomic_write,
    check_output_file,
    check_replaceable,
    check_output_folder,
    is_temp_name,
    remove_stale_temp_files,
    staged_outputs,
    temp_path,
    write_json,
    write_text,
)


def dead_pid() -> int:
    """The pid of a process that has exited."""
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def test_the_writer_never_replaces_a_file_unasked_and_a_failed_write_leaves_the_old_one(tmp_path):
    f = tmp_path / "result.json"
    write_text(f, "old")
    with pytest.raises(OutputExistsError, match="result.json exists; pass --overwrite"):
        write_text(f, "new")
    assert write_text(f, "new", overwrite=True).read_text() == "new"

    def half_then_fail(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(f, half_then_fail, overwrite=True)
    assert f.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]
    with pytest.raises(OutputError, match="nothing was written"):
        atomic_write(tmp_path / "empty", lambda tmp: None)
    assert not (tmp_path / "empty").exists()


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_written_files_honour_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        write_json(tmp_path / "r.json", {"a": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "r.json").stat().st_mode) == 0o666 & ~umask
    assert json.loads((tmp_path / "r.json").read_text()) == {"a": 1}


def test_a_writer_killed_mid_write_leaves_the_old_file_and_only_a_temporary_name_that_cleanup_removes(tmp_path):
    target = tmp_path / "model.bin"
    target.write_bytes(b"old")
    script = textwrap.dedent(f"""
        import sys, time
        from ssogvit.outputs import atomic_write
        def slow(tmp):
            with open(tmp, "wb") as f:
                f.write(b"x" * 1000); f.flush(); print("writing", flush=True); time.sleep(60)
        atomic_write({str(target)!r}, slow, overwrite=True)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "writing"
    child.send_signal(signal.SIGKILL)
    child.wait()
    left = sorted(p.name for p in tmp_path.iterdir() if p != target)
    assert target.read_bytes() == b"old" and len(left) == 1 and is_temp_name(left[0]), left
    mine = [tmp_path / ".notes.tmp", tmp_path / ".model.bin.abc.tmp", tmp_path / "model.bin.ssogvit-tmp"]
    live = temp_path(target)  # this process's own, as if being written now
    for p in (*mine, live):
        p.write_text("keep")
    assert [p.name for p in remove_stale_temp_files(tmp_path)] == left
    assert all(p.read_text() == "keep" for p in (*mine, live)) and target.read_bytes() == b"old"


def test_temporary_names_keep_the_suffix_and_name_their_writer():
    p = temp_path("/x/model.onnx")
    assert p.parent == Path("/x") and p.suffix == ".onnx" and p.name.startswith(".model.onnx.ssogvit-tmp-")
    assert f"-{os.getpid()}-" in p.name and is_temp_name(p.name) and not is_temp_name("model.onnx")


def test_an_output_file_is_checked_before_any_work(tmp_path, read_only_folder):
    (tmp_path / "file").write_text("x")
    ckpt = tmp_path / "best.ckpt"
    ckpt.write_bytes(b"weights")
    cases = [
        (tmp_path, "is a folder; give the name of a file"),
        (tmp_path / "missing" / "r.json", "the folder .*missing does not exist"),
        (tmp_path / "file" / "r.json", "file is a file, not a folder"),
        (ckpt, "best.ckpt exists; pass --overwrite to replace it"),
        ("", "expected the path of a file"),
    ]
    for path, needle in cases:
        with pytest.raises(OutputError, match=needle) as info:
            check_output_file(path, "--json")
        assert str(info.value).startswith("--json") and "\n" not in str(info.value)
    with pytest.raises(OutputError, match="is one of this command's inputs"):
        check_output_file(ckpt, "--json", overwrite=True, inputs=[ckpt])
    assert check_output_file(tmp_path / "r.json", "--json") == tmp_path / "r.json"
    with read_only_folder(tmp_path / "ro") as ro:
        with pytest.raises(OutputError, match="ro is not writable"):
            check_output_file(ro / "r.json", "--json")
        with pytest.raises(OutputError, match="cannot be created: .*ro is not writable"):
            check_output_folder(ro / "a" / "b", "--out")
    assert ckpt.read_bytes() == b"weights"


def test_an_output_folder_may_be_created_but_not_over_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    assert check_output_folder(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    assert not (tmp_path / "new").exists()  # checking creates nothing
    for path, needle in ((tmp_path / "file", "is a file, not a folder"),
                         (tmp_path / "file" / "sub", "cannot be created: .*file is a file, not a folder")):
        with pytest.raises(OutputError, match=needle):
            check_output_folder(path, "--out")


def test_staged_outputs_move_together_or_not_at_all(tmp_path):
    out = tmp_path / "new" / "analysis"
    with staged_outputs(out) as stage:
        (stage / "a.json").write_text("1")
        (stage / "sub").mkdir()
        (stage / "sub" / "b.png").write_bytes(b"png")
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == ["a.json", "sub", "sub/b.png"]
    with pytest.raises(OutputExistsError, match="a.json already exist"):
        with staged_outputs(out) as stage:
            (stage / "a.json").write_text("2")
            (stage / "c.md").write_text("new")
    assert (out / "a.json").read_text() == "1" and not (out / "c.md").exists()
    with staged_outputs(out, overwrite=True) as stage:
        (stage / "a.json").write_text("2")
    assert (out / "a.json").read_text() == "2"
    fresh = tmp_path / "fresh" / "out"
    with pytest.raises(RuntimeError):
        with staged_outputs(fresh) as stage:
            (stage / "x").write_text("x")
            raise RuntimeError("the analysis failed")
    assert not (tmp_path / "fresh").exists()  # a failed command leaves no folder behind
    assert not [p for p in out.rglob("*") if is_temp_name(p.name)]


#: methods that write a file (`Path.write_text`, `Figure.savefig`, `torch.save`, `os.replace`, `shutil.copy`, ...)
_WRITE_METHODS = {"write_text", "write_bytes", "savefig", "save", "to_csv", "replace", "rename", "copy", "copyfile",
                  "copy2", "copytree", "move"}
#: the writes that do not take a temporary name from `ssogvit.outputs`, each with the reason it may not
_OWN_WRITES = {
    ("bench/memory.py", "open"): "/proc/self/clear_refs is a kernel interface, not a file",
    ("backends/cpu.py", "replace"): "the C kernel's build cache publishes its library with its own atomic rename",
    ("train/report.py", "savefig"): "plot functions write where the caller says: report calls them in staged_outputs",
}


def _writes(tree):
    """(call, line, first argument) of every call in `tree` that writes a file."""
    import ast

    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "open":
            modes = [a.value for a in node.args[1:2] + [k.value for k in node.keywords if k.arg == "mode"]
                     if isinstance(a, ast.Constant)]
            if not any(set(str(m)) & set("wax+") for m in modes):
                continue
            name = "open"
        elif isinstance(func, ast.Name) and func.id == "save_file":  # safetensors
            name = "save_file"
        elif isinstance(func, ast.Attribute) and func.attr in _WRITE_METHODS:
            owner = ast.unparse(func.value)
            if func.attr in ("replace", "rename") and owner not in ("os", "shutil") and not node.args[1:]:
                continue  # str.replace(a, b) has two arguments too, so: a path method takes one, os.* two
            if func.attr in ("replace", "rename", "copy", "move") and owner not in ("os", "shutil", "torch"):
                continue  # str.replace, dict.copy, Tensor.copy_: not files
            if func.attr == "save" and owner not in ("torch", "OmegaConf"):
                continue
            name = func.attr
        else:
            continue
        owner = [ast.unparse(func.value)] if isinstance(func, ast.Attribute) else []
        yield name, node.lineno, " ".join(owner + [ast.unparse(a) for a in node.args[:2]])


def test_every_file_the_package_writes_goes_through_the_one_writer():
    """No surface can forget the writer: a call that writes a file must write a temporary name handed out by
    `ssogvit.outputs` (`atomic_write`'s `tmp`, a `staged_outputs` folder) or be one of the few listed with a reason.
    The writer's own helpers (`write_text(path, text)` imported from `ssogvit.outputs`) are plain functions, not
    methods, and are not matched."""
    import ast

    src = Path(__file__).resolve().parent.parent / "src" / "ssogvit"
    unexplained = []
    for file in sorted(src.rglob("*.py")):
        rel = file.relative_to(src).as_posix()
        if rel == "outputs.py":
            continue  # the writer itself
        for name, line, target in _writes(ast.parse(file.read_text())):
            if "tmp" in target or "stage" in target or (rel, name) in _OWN_WRITES:
                continue
            unexplained.append(f"{rel}:{line}: {name}({target})")
    assert not unexplained, "write through ssogvit.outputs.atomic_write or staged_outputs:\n" + "\n".join(unexplained)


def _special_nodes(tmp_path: Path) -> dict[str, Path]:
    """A FIFO, a symbolic link to a file, a folder and (where this user may make one) a character device like
    /dev/null's: nodes that are not regular files."""
    nodes = {"FIFO": tmp_path / "fifo", "symbolic link": tmp_path / "link", "folder": tmp_path / "dir"}
    os.mkfifo(nodes["FIFO"])
    (tmp_path / "target.json").write_text("kept")
    nodes["symbolic link"].symlink_to(tmp_path / "target.json")
    nodes["folder"].mkdir()
    try:
        os.mknod(tmp_path / "null", 0o666 | stat.S_IFCHR, os.stat("/dev/null").st_rdev)
        nodes["character device"] = tmp_path / "null"
    except PermissionError:
        pass
    return nodes


def test_the_writer_replaces_only_regular_files_whatever_overwrite_says(tmp_path):
    nodes = _special_nodes(tmp_path)
    for kind, node in nodes.items():
        before = os.lstat(node)
        for call in (lambda: write_text(node, "x", overwrite=True), lambda: check_output_file(node, "--out",
                                                                                              overwrite=True),
                     lambda: check_replaceable(node, "--json")):
            with pytest.raises(OutputError) as info:
                call()
            message = str(info.value)
            assert "not a regular file" in message or "is a folder" in message, (kind, message)
            assert "\n" not in message
        after = os.lstat(node)
        assert (after.st_mode, after.st_ino, after.st_rdev) == (before.st_mode, before.st_ino, before.st_rdev), kind
    assert (tmp_path / "target.json").read_text() == "kept"
    staged = tmp_path / "staged"
    staged.mkdir()
    os.mkfifo(staged / "a.json")
    with pytest.raises(OutputError, match="a.json is a FIFO"):
        with staged_outputs(staged, overwrite=True) as stage:
            (stage / "a.json").write_text("{}")
    assert stat.S_ISFIFO(os.lstat(staged / "a.json").st_mode)
    check_replaceable(tmp_path / "target.json")  # a regular file may be replaced
    check_replaceable(tmp_path / "absent")
