"""The main command's output shows the kit's lines: TensorFlow's native start-up noise on file descriptor 2
is held back, everything else written there is passed on, and BIGMEM_TRAIN_TF_LOG=1 shows it all."""

import os

from bigmem_train.train.launch import TENSORFLOW_LOG_ENV, quiet_native_start_up

NOISE = [
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
    b"I0000 00:00:1796104045.044217     484 port.cc:153] oneDNN custom operations are on. You may see\n",
    b"E0000 00:00:1796104048.487925     484 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error\n",
]
REAL = b"E0000 00:00:1 some_kernel.cc:12] out of memory allocating a tensor\n"


def write_native(lines):
    for line in lines:
        os.write(2, line)


def test_start_up_noise_is_held_back_and_other_lines_pass(capfd, monkeypatch):
    monkeypatch.delenv(TENSORFLOW_LOG_ENV, raising=False)
    with quiet_native_start_up():
        write_native([*NOISE, REAL])
    err = capfd.readouterr().err
    assert "out of memory allocating a tensor" in err
    assert "absl::InitializeLog" not in err and "cuInit" not in err and "oneDNN custom operations" not in err


def test_asked_for_the_whole_log_shows_it(capfd, monkeypatch):
    monkeypatch.setenv(TENSORFLOW_LOG_ENV, "1")
    with quiet_native_start_up():
        write_native([*NOISE, REAL])
    err = capfd.readouterr().err
    assert "cuInit" in err and "out of memory allocating a tensor" in err
