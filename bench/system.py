"""What the benchmarks read off the machine: the page cache, memory, block-layer reads."""

import os
import sys


def drop_page_cache():
    """sync; echo 3 > /proc/sys/vm/drop_caches. Returns True if it worked (needs root)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError as e:
        print(f"[bench] could not drop the page cache ({e}); numbers may be warm", file=sys.stderr)
        return False


def _field(path, name, scale=1):
    try:
        with open(path) as f:
            return int(next(l for l in f if l.startswith(name)).split()[1]) * scale
    except (OSError, StopIteration):
        return None


def meminfo_cached():
    """The page cache's size in bytes (/proc/meminfo Cached)."""
    return _field("/proc/meminfo", "Cached:", 1024)


def disk_read_bytes():
    """Bytes this process made the block layer fetch (/proc/self/io read_bytes): reads
    served from the page cache do not count."""
    return _field("/proc/self/io", "read_bytes:")


def proc_status():
    """VmRSS and VmHWM of this process in bytes."""
    return _field("/proc/self/status", "VmRSS:", 1024), _field("/proc/self/status", "VmHWM:", 1024)
