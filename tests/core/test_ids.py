"""gpusd.ids: one owner per id format.  Every id an older gpusd wrote or sent is still read;
the ids gpusd makes have one format each; anything else is refused in one line; and no other module
compiles a job or lease id expression of its own."""

from __future__ import annotations

import ast
import re

import pytest

import gpusd
from gpusd.errors import ConfigError, GpusdError, IdError
from gpusd.ids import JobId, LeaseId, PlacementId, SlurmJobId
from tests_paths import REPO

# what 0.2 wrote or accepted, by where it came from
OLD_JOB_IDS = ["3f9c0a1b22de",  # jobs.record.new_job_id (os.urandom(6).hex()): records, the lease socket
               "deadbeef", "0123456789abcdef0123456789abcdef"]  # 8 and 32 digits: job records, remote leases
OLD_LEASE_IDS = ["a1b2c3d4e5f6",  # alloc.leases (uuid4().hex[:12], later urandom(6).hex())
                 "0123456789abcdef0123456789abcdef",  # a remote lease id (pool.client: 8-32 hex)
                 "sim0-1", "Lease_X", "a" * 64]  # the lock directory's lease-<ID>.json rule, the simulator's
OLD_SLURM_IDS = ["42", "12345678901234567890", "42_3"]
OLD_PLACEMENT_IDS = ["gpusd-1a2b3c4d", "my-job.v2", "_x", "A" * 64]  # engines placement files (any name)

GARBAGE = ["", "../../etc", "-rf", "3F9C0A1B22DE\n", "abc", "x" * 65, "3f9c 0a1b", "lease/..", None, 12,
           ["3f9c0a1b22de"]]


@pytest.mark.parametrize("kind, old", [(JobId, OLD_JOB_IDS), (LeaseId, OLD_LEASE_IDS),
                                       (SlurmJobId, OLD_SLURM_IDS), (PlacementId, OLD_PLACEMENT_IDS)],
                         ids=lambda x: getattr(x, "__name__", ""))
def test_every_old_format_is_still_read(kind: type, old: list[str]) -> None:
    for text in old:
        assert kind.is_valid(text), text
        assert kind.parse(text) == text


def test_new_ids_have_the_one_format() -> None:
    jobs = {JobId.new() for _ in range(200)}
    leases = {LeaseId.new() for _ in range(200)}
    assert len(jobs) == 200 and len(leases) == 200
    assert all(re.fullmatch(r"[0-9a-f]{12}", j) for j in jobs | leases)
    placements = {PlacementId.new() for _ in range(50)}
    assert all(re.fullmatch(r"gpusd-[0-9a-f]{8}", p) for p in placements)
    # what gpusd makes, every reader of that kind reads
    assert all(JobId.is_valid(j) and LeaseId.is_valid(j) for j in jobs)
    assert all(PlacementId.is_valid(p) for p in placements)


@pytest.mark.parametrize("kind", [JobId, LeaseId, SlurmJobId, PlacementId], ids=lambda k: k.__name__)
def test_garbage_is_refused_in_one_line(kind: type) -> None:
    for text in GARBAGE:
        if text in ("abc",) and kind in (LeaseId, PlacementId):
            continue  # a short name is a lease or placement name
        assert not kind.is_valid(text), text
        with pytest.raises(IdError) as info:
            kind.parse(text, "--job")
        message = str(info.value)
        assert "\n" not in message and message.startswith("--job: not a") and kind.what in message
        assert len(message) < 200
    # an IdError is a ConfigError (exit 2, "usage" on the wire), a ValueError and a GpusdError
    assert issubclass(IdError, ConfigError) and issubclass(IdError, ValueError) and issubclass(IdError, GpusdError)
    assert gpusd.IdError is IdError


def test_a_trailing_newline_is_not_an_id() -> None:
    """The old checks (``re.match(r"^...$")``) let ``ID\\n`` through; a file name or a lease record must
    not carry one."""
    assert re.match(r"^[a-f0-9]{8,32}$", "3f9c0a1b22de\n")  # the old rule's hole
    assert not JobId.is_valid("3f9c0a1b22de\n") and not LeaseId.is_valid("a1b2c3d4e5f6\n")


def test_a_lease_id_is_never_an_option() -> None:
    """gpusd fleet-job --lease ID is built from a daemon's answer: a lease id never starts with '-'."""
    for text in ("-rf", "--help", "-"):
        assert not LeaseId.is_valid(text) and not PlacementId.is_valid(text)
    assert LeaseId.is_valid("_x-") and LeaseId.is_valid("a-b")


def test_ids_in_file_names() -> None:
    assert LeaseId.from_file_name("lease-a1b2c3d4e5f6.json") == "a1b2c3d4e5f6"
    assert LeaseId.from_file_name("lease-sim0-1.json") == "sim0-1"
    assert JobId.from_file_name("job-3f9c0a1b22de.json") == "3f9c0a1b22de"
    for name in ("lease-.json", "lease-a.b.json", "job-3f9c0a1b22de.sock", ".lease-a1b2c3d4e5f6.tmp",
                 "job-XYZ.json", "lease-json", "lease--rf.json", "lease-a1b2c3d4e5f6.json\n",
                 "job-3f9c0a1b22de.json\n", "lease-a1b2c3d4e5f6.json.tmp"):
        assert LeaseId.from_file_name(name) is None, name
        assert JobId.from_file_name(name) is None, name


def test_optional_fields() -> None:
    assert JobId.optional("3f9c0a1b22de") == "3f9c0a1b22de"
    assert JobId.optional(None) is None and JobId.optional("../x") is None and JobId.optional(7) is None
    assert SlurmJobId.optional("42_3") == "42_3" and SlurmJobId.optional("42-3") is None


# -- no other module keeps its own id expression ------------------------------------------------------
ID_CLASSES = ("a-f0-9]{8", "0-9a-f]{8", "0-9a-f]{12", "a-f0-9]{12", "A-Za-z0-9_-]{1,64}",
              "[0-9]{1,20}(_[0-9]{1,10})?")  # (the placement id's rule is also ssh's user name rule: by name)
ID_NAMES = re.compile(r"(JOB|LEASE|SLURM)[_A-Z]*(ID|NAME|RE)?$|^_?(ID_RE|JOB|SLURM_JOB)$", re.I)


def _compiled_patterns(tree: ast.AST) -> list[tuple[str, str, int]]:
    """(assigned name, pattern, line) of every ``NAME = re.compile("...")`` at any level."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            call = node.value
            func = call.func
            if (isinstance(func, ast.Attribute) and func.attr in ("compile", "match", "fullmatch")
                    and isinstance(func.value, ast.Name) and func.value.id == "re" and call.args
                    and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                out.append((names[0] if names else "", call.args[0].value, node.lineno))
    return out


def test_only_gpusd_ids_compiles_an_id_expression() -> None:
    offenders = []
    for path in sorted((REPO / "src" / "gpusd").rglob("*.py")):
        rel = path.relative_to(REPO / "src").as_posix()
        if rel == "gpusd/ids.py":
            continue
        source = path.read_text()
        tree = ast.parse(source)
        for name, pattern, line in _compiled_patterns(tree):
            if ID_NAMES.search(name) or any(c in pattern for c in ID_CLASSES):
                offenders.append(f"{rel}:{line}: {name} = re.compile({pattern!r})")
        for line_no, text in enumerate(source.splitlines(), 1):
            if "def new_job_id" in text:
                offenders.append(f"{rel}:{line_no}: a new_job_id of its own")
    assert offenders == [], "ids belong to gpusd.ids:\n" + "\n".join(offenders)


def test_the_check_sees_an_old_regex() -> None:
    """The check above fails on what 0.2 had (so it is not a test that cannot fail)."""
    old = ast.parse('JOB_ID = re.compile(r"^[0-9a-f]{12}$")\n'
                    '_LEASE_NAME = re.compile(r"^lease-([A-Za-z0-9_-]{1,64})\\.json$")')
    found = _compiled_patterns(old)
    assert [n for n, _, _ in found] == ["JOB_ID", "_LEASE_NAME"]
    assert all(ID_NAMES.search(n) for n, _, _ in found)
    assert all(any(c in p for c in ID_CLASSES) for _, p, _ in found)


def test_ids_is_cheap_to_import() -> None:
    """Core and on the quick commands' path: it imports only the standard library's os and re and
    gpusd.errors (tests/cli/test_cli_imports.py pins the commands' modules)."""
    tree = ast.parse((REPO / "src" / "gpusd" / "ids.py").read_text())
    imported = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(("." * node.level) + (node.module or ""))
    assert imported == {"__future__", "os", "re", ".errors"}


def test_gpu_uuids_have_one_rule() -> None:
    from gpusd.ids import GpuUuid

    for good in ("GPU-8f3a1c2e-aaaa-bbbb-cccc-0123456789ab", "MIG-1a2b3c4d-5e6f-7a8b-9c0d-ef0123456789",
                 "GPU-0123456789abcdef", "GPU-" + "a" * 120):
        assert GpuUuid.is_valid(good), good
    for bad in ("GPU-", "gpu-1", "GPU-1,GPU-2", "GPU-1 x", "GPU-1\n", "MIG-" + "a" * 121, "0", None, "-GPU-1"):
        assert not GpuUuid.is_valid(bad), bad
    assert GpuUuid.is_slice("MIG-1") and not GpuUuid.is_slice("GPU-1")
    with pytest.raises(IdError, match="not a GPU UUID"):
        GpuUuid.parse("GPU-1;reboot")


def test_no_module_outside_ids_writes_a_gpu_uuid_rule() -> None:
    """A GPU UUID is checked by gpusd.ids.GpuUuid only (engines/ is being moved by another change and
    keeps its own until then)."""
    src = REPO / "src" / "gpusd"
    for path in src.rglob("*.py"):
        rel = path.relative_to(src).as_posix()
        if rel == "ids.py" or rel.startswith("engines/") or rel.startswith("inventory/"):
            continue
        text = path.read_text()
        rule = r"\(\??:?GPU\|MIG\)|startswith\(\(\"GPU-\", \"MIG-\"\)\)|startswith\(\"MIG-\"\)"
        assert not re.search(rule, text), rel
