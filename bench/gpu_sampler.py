"""What nvidia-smi sees of one GPU while a benchmark's timed steps run: the most memory in use, the figure
that bench/step.py and bench/torch_gpt2.py compare, and the SM clock and power draw, which tell whether the
steps ran at the GPU's power cap (an H100 runs a d12 step at its 700 W, its clock well under the boost
clock): a step then costs energy more than it costs cycles."""
import re
import statistics
import subprocess

QUERY = "memory.used,clocks.sm,power.draw"
CLOCK = re.compile(r"SM clock median (\d+) MHz \(lowest \d+\), power median (\S+ W|n/a)")   # clock_line's


def summary(lines):
    """(peak MiB, median SM clock MHz, lowest SM clock MHz, median power W) from nvidia-smi's lines of
    QUERY, each None where no line gave a number (power.draw reads [N/A] on some GPUs)."""
    columns = [[], [], []]
    for line in lines:
        for values, field in zip(columns, line.split(",")):
            try:
                values.append(float(field))
            except ValueError:
                pass
    memory, clock, power = columns
    return (int(max(memory)) if memory else None, round(statistics.median(clock)) if clock else None,
            round(min(clock)) if clock else None, round(statistics.median(power)) if power else None)


class GpuSampler:
    """nvidia-smi's QUERY of one GPU every 50 ms while the block runs; then peak_mib, clock_mhz (median),
    lowest_clock_mhz and power_w (median), None where nothing was read (as without nvidia-smi).

    device: what nvidia-smi -i takes, an index or a PCI bus id."""

    def __init__(self, device):
        self.device = str(device)
        self.peak_mib = self.clock_mhz = self.lowest_clock_mhz = self.power_w = None

    def __enter__(self):
        try:
            self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}",
                                          "--format=csv,noheader,nounits", "-lms", "50", "-i", self.device],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:   # no nvidia-smi on the PATH: the figures stay None, the benchmark goes on
            self.proc = None
        return self

    def __exit__(self, *_):
        if self.proc is None:
            return
        self.proc.terminate()
        out = self.proc.communicate()[0]
        self.peak_mib, self.clock_mhz, self.lowest_clock_mhz, self.power_w = summary(out.splitlines())

    def clock_line(self):
        """The line the benchmarks print, which bench/table.py reads with CLOCK."""
        if self.clock_mhz is None:
            return "nvidia-smi while the steps ran: SM clock n/a"
        power = f"{self.power_w} W" if self.power_w is not None else "n/a"
        return (f"nvidia-smi while the steps ran: SM clock median {self.clock_mhz} MHz (lowest "
                f"{self.lowest_clock_mhz}), power median {power}")
