"""GPU memory in use as nvidia-smi sees it, the figure that bench/step.py and bench/torch_gpt2.py compare."""
import subprocess


class GpuMemoryPeak:
    """The most memory nvidia-smi reports in use on one GPU while the block runs (sampled every 50 ms).

    device: what nvidia-smi -i takes, an index or a PCI bus id. peak_mib stays None if nothing was read."""

    def __init__(self, device):
        self.device, self.peak_mib = str(device), None

    def __enter__(self):
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used",
                                      "--format=csv,noheader,nounits", "-lms", "50", "-i", self.device],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *_):
        self.proc.terminate()
        out = self.proc.communicate()[0]
        self.peak_mib = max((int(v) for v in out.split() if v.isdigit()), default=None)
