import contextlib
import os
import shutil
import stat
import subprocess

import pytest
import torch

# The tests run many tiny operations; one intra-op thread avoids oversubscription on small shared machines.
torch.set_num_threads(1)

# Lightning gives its logger a handler on the sys.stderr of the moment it is first imported. Imported inside a test
# that captures output (capsys), that stream is closed after the test, and every later in-process run's Lightning
# line ends in a "--- Logging error ---" traceback; imported here, it is pytest's session-wide capture.
with contextlib.suppress(ImportError):
    import lightning.pytorch  # noqa: F401


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@contextlib.contextmanager
def _read_only_folder(path):
    """`path` (created) made read-only while the context is open: `chmod 555`, or for root, who writes anyway, the
    immutable attribute (`chattr +i`); skips the test where neither holds."""
    path.mkdir(parents=True, exist_ok=True)
    immutable = os.geteuid() == 0
    if immutable:
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)],
                                                            capture_output=True).returncode:
            pytest.skip("running as root without chattr +i: no folder is read-only here")
    else:
        path.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    try:
        yield path
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        else:
            path.chmod(0o755)


@pytest.fixture
def read_only_folder():
    """`with read_only_folder(path):` a folder nobody may write to, root included, for as long as it is open."""
    return _read_only_folder
