"""A recipe's process ends by recipes.process_exit.exit_process: nothing the run left to write is
lost though the interpreter's teardown is skipped."""
import subprocess
import sys

from tests.recipes.conftest import REPO

SCRIPT = r'''
import atexit, threading, time
from recipes.process_exit import exit_process

out = open(OUT + "/text.txt", "w")           # left open, its data still in the buffer
out.write("buffered text")
raw = open(OUT + "/bytes.bin", "wb")
raw.write(b"buffered bytes")

def late():                                   # a non-daemon thread: Python waits for it
    time.sleep(0.3)
    with open(OUT + "/thread.txt", "w") as f:
        f.write("thread finished")

threading.Thread(target=late).start()
atexit.register(lambda: open(OUT + "/atexit.txt", "w").write("atexit ran"))
print("last line", end="")                    # no newline: still in stdout's buffer
exit_process(3)
'''


def test_exit_keeps_buffers_threads_and_atexit_and_the_code(tmp_path):
    result = subprocess.run([sys.executable, "-c", f"OUT = {str(tmp_path)!r}\n" + SCRIPT], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 3, result.stderr
    assert result.stdout == "last line"
    assert (tmp_path / "text.txt").read_text() == "buffered text"
    assert (tmp_path / "bytes.bin").read_bytes() == b"buffered bytes"
    assert (tmp_path / "thread.txt").read_text() == "thread finished"
    assert (tmp_path / "atexit.txt").read_text() == "atexit ran"
