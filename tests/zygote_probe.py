"""Run as `python -m zygote_probe CODE` by tests/test_server_zygote.py, from a server zygote or
not: reports what a started process sees (session, directory, arguments, environment) as one
JSON line on stdout and exits with CODE (`sleep`: runs until it is stopped)."""
import json
import os
import sys
import time

if __name__ == "__main__":
    print(json.dumps({"pid": os.getpid(), "sid": os.getsid(0), "pgid": os.getpgid(0), "cwd": os.getcwd(),
                      "argv": sys.argv, "probe": os.environ.get("HACK_PROBE"),
                      "zygote_env": os.environ.get("HACK_SERVER_ZYGOTE"), "main": __name__,
                      "cmdline": open("/proc/self/cmdline").read().replace("\0", " ").strip(),
                      "netns_inode": os.stat("/proc/self/ns/net").st_ino, "devices": sorted(os.listdir("/sys/class/net")),
                      "resolv": open("/etc/resolv.conf").read() if os.path.exists("/etc/resolv.conf") else None}),
          flush=True)
    if sys.argv[1] == "sleep":  # a server that runs until stopped
        time.sleep(600)
    sys.exit(int(sys.argv[1]))
