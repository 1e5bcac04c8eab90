"""benchmarks.bench_loop's --gpus: indices into the caller's CUDA_VISIBLE_DEVICES, one clear line for bad input, and
a rendezvous port of its own for every case process (two cases side by side once both took 29500)."""
import pytest

from benchmarks.bench_loop import child_env, physical_gpus


def test_indices_count_the_cards_the_caller_left_visible(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert physical_gpus("0") == [3]
    assert physical_gpus("1,0") == [1, 3]
    assert child_env("trl", physical_gpus("1")[0], False)["CUDA_VISIBLE_DEVICES"] == "1"


def test_without_cuda_visible_devices_indices_are_the_cards(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert physical_gpus("0,1") == [0, 1]


@pytest.mark.parametrize("visible, spec, message", [
    (None, "0,x", "expected GPU indices separated by commas"),
    (None, "1,1", "names a GPU twice"),
    (None, "-1", "from 0"),
    ("1", "1", "counts the 1 GPU(s)"),
    ("", "0", "counts the 0 GPU(s)"),
    ("GPU-5e1c", "0", "is not a list of GPU indices"),
])
def test_bad_gpus_fail_with_one_line_naming_the_argument(monkeypatch, visible, spec, message):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with pytest.raises(SystemExit) as failed:
        physical_gpus(spec)
    assert str(failed.value).startswith("--gpus: ") and message in str(failed.value)
    assert "\n" not in str(failed.value)


def test_each_case_process_gets_its_own_rendezvous_port():
    ports = {child_env("trl", gpu, False)["MASTER_PORT"] for gpu in (0, 1)}
    assert len(ports) == 2 and all(1024 < int(p) < 65536 for p in ports)


def test_a_port_given_once_is_not_given_again(monkeypatch):
    """The OS may hand the port just freed out again; two cases side by side then shared a rendezvous port."""
    import socket

    from benchmarks import bench_loop

    ports = iter([40001, 40001, 40002])

    class Socket:  # binds to port 0 and is told the OS's choice: here the same one twice in a row
        def __init__(self, *args):
            self.port = next(ports)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            pass

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(socket, "socket", Socket)
    assert [bench_loop.free_port(), bench_loop.free_port()] == [40001, 40002]
