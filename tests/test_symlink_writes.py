"""No write through a planted symlink (shared folders: whoever can create a file in OUT must not be able to make a
root-run ktconvert clobber another file). For every writer a symlink is put at the lock, the temporary and the
final names it uses, pointing at a victim file outside OUT; the victim's bytes must stay as they were. A symlink
at the lock (or a folder symlink below OUT) is refused with exit 1 naming it; one at a temporary name is removed,
never followed; one at a final name is replaced by the rename. `bundle` refuses an existing DEST without --force."""
from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from ktconvert.cli.main import cli
from ktconvert.errors import InputError, OutputError
from ktconvert.formats import fileio
from ktconvert.formats.fileio import temp_path_for, write_atomic
from ktconvert.formats.out_manifest import JOURNAL_NAME, LOCK_NAME, MANIFEST_NAME
from ktconvert.distributed.parts import PART_NAME

CPU = ["--method", "amxint4", "--numa", "2", "--quiet"]
GPU = ["--experts", "w8a16", "--quiet"]
PRECIOUS = b"precious bytes that ktconvert must never write\n"


def run(*args) -> tuple[int, str]:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.output


class Victims:
    """Files outside OUT, each a symlink's target; `untouched()` checks every one still holds PRECIOUS."""

    def __init__(self, root: Path):
        self.root = root / "victims"
        self.root.mkdir(exist_ok=True)
        self.files: list[Path] = []

    def plant(self, link: Path) -> Path:
        """A symlink at `link` to a new victim file; returns the victim."""
        victim = self.root / f"victim-{len(self.files)}"
        victim.write_bytes(PRECIOUS)
        self.files.append(victim)
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(victim, link)
        return victim

    def untouched(self) -> bool:
        return all(v.read_bytes() == PRECIOUS for v in self.files)


@pytest.fixture
def victims(tmp_path):
    return Victims(tmp_path)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("deepseek_v3", layers=4, experts=4, hidden=128, intermediate=256)   # MoE layers 1..3


def _finished(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _visible(root: Path) -> dict[str, bytes]:
    """_finished without hidden names (a stale temporary some writers leave alone, a link there included)."""
    return {rel: data for rel, data in _finished(root).items() if not Path(rel).name.startswith(".")}


def _interrupted(monkeypatch, *args) -> None:
    """Run the CLI with the output's finalize failing: every layer written and journalled, no ktconvert.json."""
    from ktconvert.run.output import Output

    def fail(self):
        raise OutputError("stopped before finalize (test)")

    with monkeypatch.context() as patch:
        patch.setattr(Output, "finalize", fail)
        code, out = run(*args)
    assert code == 1 and "stopped before finalize" in out


def _plant_temporaries(out: Path, names: list[str], victims: Victims) -> None:
    """A symlink at the temporary name of every file in `names` (paths relative to OUT), at the journal's and the
    write probe's temporaries, all to victims."""
    for rel in names:
        victims.plant(temp_path_for(out / rel))
    victims.plant(out / (JOURNAL_NAME + ".tmp"))
    victims.plant(out / ".ktconvert-write-test")


# ---------------------------------------------------------------------------------------------- the lock

@pytest.mark.parametrize("kind", ["cpu", "gpu"])
def test_fresh_run_refuses_a_symlinked_lock(model, tmp_path, victims, kind):
    out = tmp_path / "out"
    victim = victims.plant(out / LOCK_NAME)
    code, text = run(kind, model, out, *(CPU if kind == "cpu" else GPU))
    assert code == 1 and "lock file is a symlink" in text and LOCK_NAME in text, text
    assert victims.untouched() and os.path.islink(out / LOCK_NAME) and victim.exists()


@pytest.mark.parametrize("flag", ["--resume", "--force"])
def test_resume_and_force_refuse_a_symlinked_lock(model, tmp_path, victims, flag):
    out = tmp_path / "out"
    assert run("cpu", model, out, *CPU)[0] == 0
    victims.plant(out / LOCK_NAME)
    code, text = run("cpu", model, out, *CPU, flag)
    assert code == 1 and "lock file is a symlink" in text, text
    assert victims.untouched()


def test_convert_refuses_a_symlinked_lock_in_any_output(model, tmp_path, victims):
    victims.plant(tmp_path / "g" / LOCK_NAME)
    code, text = run("convert", model, "--cpu", tmp_path / "c", "--method", "amxint4", "--numa", "2",
                     "--gpu", tmp_path / "g", "--experts", "w8a16", "--quiet")
    assert code == 1 and "lock file is a symlink" in text, text
    assert victims.untouched() and not (tmp_path / "c" / MANIFEST_NAME).exists()


def test_part_refuses_a_symlinked_lock(model, tmp_path, victims):
    part = tmp_path / "part"
    victims.plant(part / LOCK_NAME)
    code, text = run("cpu", model, part, *CPU, "--layers", "1-1")
    assert code == 1 and "lock file is a symlink" in text, text
    assert victims.untouched()


def test_lock_hard_link_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    other = tmp_path / "other"
    other.write_bytes(PRECIOUS)
    os.link(other, out / LOCK_NAME)
    with pytest.raises(OutputError, match="not a regular file of its own"):
        fileio.open_lock(out / LOCK_NAME)
    assert other.read_bytes() == PRECIOUS


# ---------------------------------------------------------------------------------------------- resumed runs

@pytest.mark.parametrize("kind,args,finished", [
    ("cpu", CPU, MANIFEST_NAME),
    ("gpu", GPU, MANIFEST_NAME),
    ("cpu", CPU + ["--layers", "1-1"], PART_NAME),          # a part, as a Ray task writes it
], ids=["cpu", "gpu", "part"])
def test_resume_writes_no_temporary_or_final_name_through_a_symlink(model, tmp_path, monkeypatch, victims, kind,
                                                                    args, finished):
    clean = tmp_path / "clean"
    assert run(kind, model, clean, *args)[0] == 0
    reference = _finished(clean)
    out = tmp_path / "out"
    _interrupted(monkeypatch, kind, model, out, *args)
    shards = sorted(rel for rel in reference if rel.endswith(".safetensors") and (out / rel).is_file())
    (out / shards[0]).unlink()                               # redone on resume: its temporary and final name used
    _plant_temporaries(out, list(reference), victims)
    victims.plant(out / shards[0])
    victims.plant(out / finished)
    code, text = run(kind, model, out, *args, "--resume")
    assert code == 0, text
    assert victims.untouched()
    assert _visible(out) == reference                        # the links were replaced by the real files
    assert not any(p.is_symlink() for p in out.rglob("*") if not p.name.startswith("."))


def test_kt_layout_never_writes_through_a_symlinked_layer_folder(model, tmp_path, monkeypatch, victims):
    args = ["--method", "amxint4", "--numa", "2", "--layout", "kt", "--quiet"]
    clean = tmp_path / "clean"
    assert run("cpu", model, clean, *args)[0] == 0
    out = tmp_path / "out"
    _interrupted(monkeypatch, "cpu", model, out, *args)
    layer = sorted(p.name for p in out.glob("_layer_*"))[0]
    inner = sorted(p.relative_to(out / layer) for p in (out / layer).rglob("*.kt"))
    shutil.rmtree(out / layer)                               # the layer is redone on resume
    trap = victims.root / "trap"                             # a folder of victims named like the layer's files
    for rel in inner[:3]:
        victims.files.append(trap / rel)
        (trap / rel).parent.mkdir(parents=True, exist_ok=True)
        (trap / rel).write_bytes(PRECIOUS)
    os.symlink(trap, out / f"{layer}.partial")
    code, text = run("cpu", model, out, *args, "--resume")
    assert code == 0, text
    assert victims.untouched() and sorted(p.relative_to(trap) for p in trap.rglob("*.kt")) == inner[:3]
    assert _finished(out) == _finished(clean)


# ---------------------------------------------------------------------------------------------- merge

@pytest.fixture(scope="module")
def parts(model, tmp_path_factory):
    from ktconvert import api

    root = tmp_path_factory.mktemp("parts")
    for text in ("1-1", "2-3"):
        api.convert_cpu(model, root / text, layers=text, method="amxint4", numa=2)
    single = root / "single"
    api.convert_cpu(model, single, method="amxint4", numa=2)
    return [root / "1-1", root / "2-3"], single


def test_merge_refuses_a_symlinked_lock(parts, tmp_path, victims):
    out = tmp_path / "merged"
    victims.plant(out / LOCK_NAME)
    code, text = run("merge", out, *parts[0])
    assert code == 1 and "lock file is a symlink" in text, text
    assert victims.untouched()


def test_merge_never_writes_through_a_symlink(parts, tmp_path, monkeypatch, victims):
    from ktconvert.distributed import merge as merge_module
    out = tmp_path / "merged"
    with monkeypatch.context() as patch:                     # interrupted before ktconvert.json
        patch.setattr(merge_module, "write_manifest", lambda *a: (_ for _ in ()).throw(OutputError("stop")))
        assert run("merge", out, *parts[0])[0] == 1
    reference = _finished(parts[1])
    shards = sorted(rel for rel in reference if rel.endswith(".safetensors"))
    for rel in shards[:2]:
        (out / rel).unlink()
        victims.plant(out / rel)                             # a link at a final name: replaced, not kept or followed
    for rel in reference:
        victims.plant(temp_path_for(out / rel))
    real_link = os.link

    def cross_device(src, dst, **kw):                        # the first file is copied, as across filesystems
        if Path(dst).name == Path(shards[0]).name:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_link(src, dst, **kw)

    monkeypatch.setattr(merge_module.os, "link", cross_device)
    code, text = run("merge", out, *parts[0])
    assert code == 0, text
    assert victims.untouched()
    assert _finished(out) == reference and not any(p.is_symlink() for p in out.rglob("*"))


def test_merge_refuses_a_symlinked_folder(model, tmp_path, monkeypatch, victims):
    from ktconvert import api
    from ktconvert.distributed import merge as merge_module
    args = dict(method="amxint4", numa=2, layout="kt")
    for text in ("1-1", "2-3"):
        api.convert_cpu(model, tmp_path / text, layers=text, **args)
    layer = sorted(p.name for p in (tmp_path / "2-3").glob("_layer_*"))[0]
    trap = victims.root / "trap"
    for path in (tmp_path / "2-3" / layer).rglob("*.kt"):     # victims named like the part's files
        target = trap / path.relative_to(tmp_path / "2-3" / layer)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(PRECIOUS)
        victims.files.append(target)
    out = tmp_path / "merged"
    with monkeypatch.context() as patch:                     # an unfinished merge, which the same merge finishes
        patch.setattr(merge_module, "write_manifest", lambda *a: (_ for _ in ()).throw(OutputError("stop")))
        assert run("merge", out, tmp_path / "1-1", tmp_path / "2-3")[0] == 1
    shutil.rmtree(out / layer)
    os.symlink(trap, out / layer)
    code, text = run("merge", out, tmp_path / "1-1", tmp_path / "2-3")
    assert code == 1 and "symlink" in text and layer in text, text
    assert victims.untouched() and not (out / MANIFEST_NAME).exists()


# ---------------------------------------------------------------------------------------------- bundle, batch

@pytest.fixture(scope="module")
def finished(model, tmp_path_factory):
    from ktconvert import api

    out = tmp_path_factory.mktemp("finished") / "out"
    api.convert_cpu(model, out, method="amxint4", numa=2)
    return out


def test_bundle_temporary_symlink_is_not_followed(finished, tmp_path, victims):
    dest = tmp_path / "b.tar.zst"
    victims.plant(temp_path_for(dest))
    code, text = run("bundle", finished, dest, "--quiet")
    assert code == 0, text
    assert victims.untouched() and not dest.is_symlink() and run("verify", dest)[0] == 0


def test_bundle_refuses_an_existing_dest_without_force(finished, tmp_path, victims):
    dest = tmp_path / "b.tar.zst"
    dest.write_bytes(PRECIOUS)
    code, text = run("bundle", finished, dest, "--quiet")
    assert code == 1 and "exists" in text and "--force" in text, text
    assert dest.read_bytes() == PRECIOUS
    link = tmp_path / "link.tar.zst"
    victims.plant(link)
    code, text = run("bundle", finished, link, "--quiet")
    assert code == 1 and "exists" in text, text
    code, text = run("bundle", finished, link, "--quiet", "--force")        # the link replaced, not followed
    assert code == 0, text
    assert victims.untouched() and not link.is_symlink() and run("verify", link)[0] == 0
    assert run("bundle", finished, dest, "--quiet", "--force")[0] == 0 and dest.read_bytes() == link.read_bytes()


def test_unbundle_members_never_written_through_a_symlink(finished, tmp_path, victims):
    bundle = tmp_path / "b.tar.zst"
    assert run("bundle", finished, bundle, "--quiet")[0] == 0
    dest = tmp_path / "restored"
    victims.plant(dest.with_name(f".{dest.name}.partial"))   # the temporary folder: a link there is removed
    code, text = run("unbundle", bundle, dest, "--quiet")
    assert code == 0, text
    assert victims.untouched() and _finished(dest) == _finished(finished)


BATCH = """
[[jobs]]
name = "j"
source = "{source}"
out = "out"
method = "amxint4"
numa = 2
bundle = "{bundle}"
"""


@pytest.mark.parametrize("where", ["source", "out"])
def test_batch_refuses_a_bundle_path_inside_a_source_or_output(model, tmp_path, where):
    from ktconvert.ops.batch import load_jobs

    bundle = f"{model}/config.json" if where == "source" else "out/x.tar.zst"
    jobs = tmp_path / "jobs.toml"
    jobs.write_text(BATCH.format(source=model, bundle=bundle))
    before = (model / "config.json").read_bytes()
    with pytest.raises(InputError, match="'bundle' lies inside a"):
        load_jobs(jobs)
    code, text = run("batch", jobs, "--quiet")
    assert code == 3 and "bundle" in text, text
    assert (model / "config.json").read_bytes() == before


def test_batch_rebundles_its_own_bundle_but_not_another_file(model, tmp_path, victims):
    jobs = tmp_path / "jobs.toml"
    jobs.write_text(BATCH.format(source=model, bundle="dist/x.tar.zst"))
    summary = tmp_path / "summary.json"
    victims.plant(temp_path_for(summary))
    assert run("batch", jobs, "--quiet", "--summary", summary)[0] == 0
    assert victims.untouched() and json.loads(summary.read_text())["ok"]
    first = (tmp_path / "dist" / "x.tar.zst").read_bytes()
    assert run("batch", jobs, "--quiet")[0] == 0                           # a rerun: its own bundle, rewritten
    assert (tmp_path / "dist" / "x.tar.zst").read_bytes() == first
    (tmp_path / "dist" / "x.tar.zst").unlink()
    victims.plant(tmp_path / "dist" / "x.tar.zst")                          # something else there: refused
    code, text = run("batch", jobs, "--quiet")
    assert code == 1 and "not this output's bundle" in text, text
    assert victims.untouched()


# ---------------------------------------------------------------------------------------------- expert-stats

def test_expert_stats_never_writes_through_a_symlink(model, tmp_path, victims, calibration):
    pytest.importorskip("torch")
    out, report = tmp_path / "stats.pt", tmp_path / "stats.html"
    victims.plant(temp_path_for(out))
    victims.plant(temp_path_for(report))
    code, text = run("expert-stats", model, out, "--calibration", calibration, "--report", report, "--quiet")
    assert code == 0, text
    assert victims.untouched() and out.is_file() and not out.is_symlink()
    link = tmp_path / "link.pt"
    victims.plant(link)
    code, text = run("expert-stats", model, link, "--calibration", calibration, "--quiet")
    assert code == 1 and "--force" in text, text
    code, text = run("expert-stats", model, link, "--calibration", calibration, "--quiet", "--force")
    assert code == 0, text
    assert victims.untouched() and not link.is_symlink() and link.read_bytes() == out.read_bytes()


# ---------------------------------------------------------------------------------------------- journal, helper

def test_journal_and_stream_state_never_write_through_a_symlink(tmp_path, victims):
    from ktconvert.run.journal import Journal

    victims.plant(tmp_path / (JOURNAL_NAME + ".tmp"))
    journal = Journal.start(tmp_path, {"method": "x"}, resume=False)
    journal.finish_layer(1, [], {})
    assert victims.untouched() and json.loads((tmp_path / JOURNAL_NAME).read_text())["layers"] == {"1": {
        "files": [], "tensors": {}}}
    victims.plant(tmp_path / "link")
    os.replace(tmp_path / "link", tmp_path / JOURNAL_NAME)  # the journal itself a link: replaced by the rename
    journal.finish_layer(2, [], {})
    assert victims.untouched() and not (tmp_path / JOURNAL_NAME).is_symlink()

    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from ktconvert.formats.out_manifest import STREAM_STATE_NAME
    from ktconvert.gptq.resume import StreamState

    victims.plant(tmp_path / (STREAM_STATE_NAME + ".tmp"))
    StreamState(tmp_path, "d" * 64).save(SimpleNamespace(done=1, hidden=[torch.zeros(2)]), {}, force=True)
    assert victims.untouched() and (tmp_path / STREAM_STATE_NAME).is_file()


def test_helper_refuses_a_link_planted_between_removal_and_creation(tmp_path, victims, monkeypatch):
    target = tmp_path / "f.bin"
    victims.plant(temp_path_for(target))
    write_atomic(target, b"data")                           # a stale link: removed, never followed
    assert victims.untouched() and target.read_bytes() == b"data"
    victims.plant(temp_path_for(target))
    monkeypatch.setattr(fileio, "remove_name", lambda *a, **k: None)   # as if planted again right after removal
    with pytest.raises(OutputError, match="appeared at this name"):
        write_atomic(target, b"other")
    with pytest.raises(OutputError, match="appeared at this name"):
        os.close(fileio.create_new(temp_path_for(target)))
    assert victims.untouched() and target.read_bytes() == b"data"


def test_new_file_below_a_folder_never_follows_a_symlinked_folder(tmp_path, victims):
    out = tmp_path / "out"
    out.mkdir()
    trap = victims.root / "trapdir"
    trap.mkdir()
    os.symlink(trap, out / "sub")
    with pytest.raises(OutputError, match="symlink"):
        fileio.NewFile(out / "sub" / "deeper" / "x.bin", within=out)
    assert list(trap.iterdir()) == []
    new = fileio.NewFile(out / "a" / "b" / "x.bin", within=out)    # missing folders are made
    os.write(new.fd, b"ok")
    new.commit()
    assert (out / "a" / "b" / "x.bin").read_bytes() == b"ok"


def test_ray_part_refuses_a_symlinked_lock(cluster, model, tmp_path, victims):
    out = tmp_path / "out"
    victims.plant(tmp_path / "out.parts" / "out" / "layers-2-2" / LOCK_NAME)
    code, text = run("cpu", model, out, *CPU, "--executor", "ray", "--parts", "3")
    assert code == 1 and "lock file is a symlink" in text and "layers-2-2" in text, text
    assert victims.untouched() and not (out / MANIFEST_NAME).exists()
