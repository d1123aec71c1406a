"""python -m composite.deploy: push an export to a phone, run composite_runner there, pull the stats.

  push --artifacts DIR   manifest, shards (and the data file they share), tokenizer, the runner binary with every shared library
                         it links that the device does not have (composite.bundle) and, for QNN
                         placements, the QNN runtime libraries the SoC needs; files whose sha256
                         already matches on the device are skipped
  run --prompt TEXT      runs composite_runner on the device with only the pushed folder on its
                         library path and ADSP_LIBRARY_PATH set, streams its output, pulls the
                         stats JSON back

--transport adb (the default) uses Debian's adb; --transport local does the same steps against a
local folder that stands in for the device's file system, with the host-built runner.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath

from composite import manifest as manifest_schema
from composite import manifest_files, qnn_host
from composite.bundle import library_closure
from composite.errors import UserError, exits_cleanly
from composite.manifest_files import sha256_file as file_sha256
from composite.qnn_soc import htp_arch
from composite.units import MB

PROJECT = Path(__file__).resolve().parent.parent

DEFAULT_DEVICE_DIR = "/data/local/tmp/composite"
QNN_SUBDIR = "qnn"  # holds the QNN runtime libraries on the device
# Where Android's DSP loader finds the skel libraries, after our own folder.
ADSP_SYSTEM_DIRS = ("/vendor/lib/rfsa/adsp", "/vendor/dsp/cdsp", "/system/lib/rfsa/adsp", "/dsp")


class LocalTransport:
    """The device's file system as a folder on this machine; commands run here with bash."""

    name = "local"

    def __init__(self, root: Path):
        self.root = root

    def _local(self, remote: str) -> Path:
        return self.root / PurePosixPath(remote).relative_to("/")

    def sha256(self, remotes: list[str]) -> dict[str, str]:
        return {r: file_sha256(self._local(r)) for r in remotes if self._local(r).is_file()}

    def push(self, local: Path, remote: str) -> None:
        target = self._local(remote)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(local, target)

    def pull(self, remote: str, local: Path) -> bool:
        if not self._local(remote).is_file():
            return False
        shutil.copy2(self._local(remote), local)
        return True

    def device_path(self, remote: str) -> str:
        return str(self._local(remote))

    def shell(self, command: str, qnn: bool = False) -> int:
        """Runs with the host's environment less its loader path, so the pushed libraries are all
        the runner sees. The one thing a phone does not need: with QNN shards, the simulator's ABI
        shim (pushed as libQnnHtp.so) is told where this machine's real libQnnHtp.so is."""
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("LD_LIBRARY_PATH", qnn_host.ACTIVE_MARKER, qnn_host.REAL_HTP_VARIABLE)
        }
        if qnn:
            env[qnn_host.REAL_HTP_VARIABLE] = str(qnn_host.prepare().real_htp)
        return subprocess.run(["bash", "-c", command], env=env).returncode


class AdbTransport:
    name = "adb"

    def __init__(self, serial: str | None):
        self.adb = shutil.which("adb")
        if self.adb is None:
            raise UserError("adb not found on PATH: install it (apt-get install adb) or use --transport local")
        listing = self._run("devices", device=False).stdout
        devices = [line.split()[0] for line in listing.splitlines()[1:] if line.strip().endswith("device")]
        if not devices:
            raise UserError(
                "no Android device connected ('adb devices' lists none): plug one in and allow USB debugging"
            )
        if serial is None:
            if len(devices) > 1:
                raise UserError(f"{len(devices)} devices connected ({', '.join(devices)}): choose one with --serial")
            serial = devices[0]
        elif serial not in devices:
            raise UserError(f"device '{serial}' is not connected (connected: {', '.join(devices)})")
        self.serial = serial

    def _run(self, *args: str, device: bool = True, check: bool = False) -> subprocess.CompletedProcess:
        command = [self.adb, *(["-s", self.serial] if device else []), *args]
        done = subprocess.run(command, capture_output=True, text=True)
        if check and done.returncode != 0:
            detail = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}").splitlines()[-1]
            raise UserError(f"adb {' '.join(args[:2])} failed: {detail}")
        return done

    def sha256(self, remotes: list[str]) -> dict[str, str]:
        quoted = " ".join(shlex.quote(r) for r in remotes)
        out = self._run("shell", f"sha256sum {quoted} 2>/dev/null").stdout
        hashes = {}
        for line in out.splitlines():
            parts = line.split(None, 1)
            if len(parts) == 2:
                hashes[parts[1].strip()] = parts[0]
        return hashes

    def push(self, local: Path, remote: str) -> None:
        self._run("shell", f"mkdir -p {shlex.quote(str(PurePosixPath(remote).parent))}", check=True)
        self._run("push", str(local), remote, check=True)

    def pull(self, remote: str, local: Path) -> bool:
        return self._run("pull", remote, str(local)).returncode == 0

    def device_path(self, remote: str) -> str:
        return remote

    def shell(self, command: str, qnn: bool = False) -> int:
        return subprocess.run([self.adb, "-s", self.serial, "shell", command]).returncode


def open_transport(args) -> LocalTransport | AdbTransport:
    if args.transport == "local":
        return LocalTransport(Path(args.local_root).resolve())
    return AdbTransport(args.serial)


def read_manifest(artifacts: Path) -> dict:
    manifest = manifest_schema.read(artifacts)
    manifest_files.check_files(artifacts, manifest)
    return manifest


def qnn_socs(manifest: dict) -> list[str]:
    return sorted({s["placement"]["options"]["soc"] for s in manifest["shards"] if s["placement"]["backend"] == "qnn"})


def qnn_libraries(manifest: dict, transport_name: str) -> list[Path]:
    """The QNN runtime libraries the export's SoCs need, from QNN_SDK_ROOT (on a phone) or from
    the host libraries composite runs the HTP simulator with (--transport local)."""
    socs = qnn_socs(manifest)
    if not socs:
        return []
    if transport_name == "local":
        folder = qnn_host.prepare().lib_dir
        return sorted(p for p in folder.glob("libQnn*.so")) + sorted(folder.glob("libHtp*.so"))
    root = os.environ.get("QNN_SDK_ROOT")
    if not root:
        raise UserError(
            f"the export has QNN shards for {', '.join(socs)}: set QNN_SDK_ROOT to the Qualcomm AI Engine "
            "Direct SDK whose runtime libraries go to the phone"
        )
    sdk = Path(root)
    needed = [sdk / "lib/aarch64-android/libQnnHtp.so", sdk / "lib/aarch64-android/libQnnSystem.so"]
    for soc in socs:
        arch = htp_arch(soc)
        needed += [
            sdk / f"lib/aarch64-android/libQnnHtpV{arch}Stub.so",
            sdk / f"lib/hexagon-v{arch}/unsigned/libQnnHtpV{arch}Skel.so",
        ]
    missing = [p for p in needed if not p.is_file()]
    if missing:
        raise UserError(
            f"QNN libraries for {', '.join(socs)} missing under QNN_SDK_ROOT={root}: "
            f"{', '.join(str(p.relative_to(sdk)) for p in missing)}"
        )
    return needed


def check_qnn_version(manifest: dict, libraries: list[Path], transport_name: str, allow_mismatch: bool) -> None:
    """The QNN libraries to push are the version the export's context binaries were compiled with
    (a context binary from one QNN version is refused, or misbehaves, under another's libraries)."""
    expected = (manifest.get("qnn") or {}).get("build_id")
    if not expected or not libraries:
        return
    if transport_name == "local":
        found = qnn_host.prepare().build_id  # the host libraries answer themselves
    else:
        htp = next(lib for lib in libraries if lib.name == "libQnnHtp.so")
        found = qnn_host.build_id_in_file(htp) or f"of unknown version ({htp} names none)"
    if found != expected and not allow_mismatch:
        raise UserError(
            f"the export's QNN shards were compiled with QNN {expected} but the QNN libraries to push are {found}: "
            f"export again with these libraries or push those of {expected} (--allow-qnn-mismatch pushes anyway)"
        )


def default_runner(transport_name: str) -> Path:
    return PROJECT / ("build/composite_runner" if transport_name == "local" else "build-android/composite_runner")


EVAL_SUBDIR = "eval"  # an evaluation's text and kld-base file, on the device


def plan_files(
    artifacts: Path,
    manifest: dict,
    runner: Path,
    transport_name: str,
    device_dir: str,
    library_path: list[Path],
    eval_files: tuple[Path, ...] = (),
    allow_qnn_mismatch: bool = False,
) -> list[tuple[Path, str]]:
    """Everything to push, checked to exist before anything is pushed."""
    if not runner.is_file():
        how = "bash scripts/build_runner.sh build" if transport_name == "local" else "bash scripts/build_android.sh"
        raise UserError(f"runner binary {runner} not found: build it ({how}) or pass --runner")
    files = [(artifacts / "manifest.json", "manifest.json")]
    files += [(artifacts / s["file"], s["file"]) for s in manifest["shards"]]
    data_files = dict.fromkeys(s["data"]["file"] for s in manifest["shards"] if "data" in s)  # shared: once
    files += [(artifacts / name, name) for name in data_files]
    if manifest.get("tokenizer"):
        files.append((artifacts / manifest["tokenizer"]["file"], manifest["tokenizer"]["file"]))
    files.append((runner, "composite_runner"))
    files += [(lib, lib.name) for lib in library_closure(runner, library_path)]
    qnn = qnn_libraries(manifest, transport_name)
    check_qnn_version(manifest, qnn, transport_name, allow_qnn_mismatch)
    files += [(lib, f"{QNN_SUBDIR}/{lib.name}") for lib in qnn]
    for local in eval_files:
        if not local.is_file():
            raise UserError(f"{local} does not exist")
        files.append((local, f"{EVAL_SUBDIR}/{local.name}"))
    for local, _ in files:
        if not local.is_file():
            raise UserError(f"{local} is missing: the export is incomplete")
    return [(local.resolve(), f"{device_dir}/{name}") for local, name in files]


def push(args) -> None:
    artifacts = Path(args.artifacts)
    manifest = read_manifest(artifacts)
    runner = Path(args.runner) if args.runner else default_runner(args.transport)
    library_path = [Path(d) for d in args.library_path.split(os.pathsep) if d] if args.library_path else []
    eval_files = tuple(Path(f) for f in (args.eval_text, args.kld_base) if f)
    files = plan_files(
        artifacts, manifest, runner, args.transport, args.device_dir, library_path, eval_files, args.allow_qnn_mismatch
    )
    transport = open_transport(args)
    on_device = transport.sha256([remote for _, remote in files])
    pushed, skipped, pushed_bytes = 0, 0, 0
    for local, remote in files:
        if on_device.get(remote) == file_sha256(local):
            skipped += 1
            continue
        transport.push(local, remote)
        pushed += 1
        pushed_bytes += local.stat().st_size
    where = f"{transport.name}:{transport.device_path(args.device_dir)}"
    print(f"pushed {pushed} files ({pushed_bytes / MB:.1f} MB), skipped {skipped} unchanged -> {where}")


def run(args) -> int:
    transport = open_transport(args)
    device_dir = transport.device_path(args.device_dir)
    if transport.name == "local" and not Path(device_dir, "composite_runner").is_file():
        raise UserError(f"nothing pushed to {device_dir}: run 'python -m composite.deploy push' first")
    runner_args = ["--artifacts", device_dir, "--stats_json", f"{device_dir}/stats.json"]
    if args.chat:  # the user's turns: this process's stdin, which both transports hand to the runner
        runner_args += ["--chat"]
    elif args.eval_text is not None:  # files `push --eval-text/--kld-base` put in the device folder
        runner_args += ["--eval_text", f"{device_dir}/{EVAL_SUBDIR}/{Path(args.eval_text).name}"]
        if args.kld_base:
            runner_args += ["--kld_base", f"{device_dir}/{EVAL_SUBDIR}/{Path(args.kld_base).name}"]
    elif args.prompt is not None:
        runner_args += ["--prompt", args.prompt]
    else:
        runner_args += ["--prompt_ids", args.prompt_ids]
    runner_args += args.runner_args
    qnn_dir = f"{device_dir}/{QNN_SUBDIR}"
    adsp = ";".join((qnn_dir, *ADSP_SYSTEM_DIRS))
    # The pushed folder only: the runner's own libraries sit beside it, QNN's in qnn/.
    library_path = f"{device_dir}:{qnn_dir}"
    command = (
        f"cd {shlex.quote(device_dir)} && LD_LIBRARY_PATH={shlex.quote(library_path)} "
        f"ADSP_LIBRARY_PATH={shlex.quote(adsp)} ./composite_runner {' '.join(shlex.quote(a) for a in runner_args)}"
    )
    code = transport.shell(command, qnn=transport.name == "local" and Path(device_dir, QNN_SUBDIR).is_dir())
    if code != 0:
        raise UserError(f"composite_runner on {transport.name} exited with {code} (its message is above)")
    stats_out = Path(args.stats_out)
    try:
        stats_out.parent.mkdir(parents=True, exist_ok=True)
        pulled = transport.pull(f"{args.device_dir}/stats.json", stats_out)
    except OSError as e:
        raise UserError(f"cannot write --stats-out {stats_out}: {e.strerror}") from None
    if not pulled:
        raise UserError("composite_runner finished but left no stats.json to pull")
    print(f"stats: {stats_out}  (python -m composite.report {stats_out})")
    return 0


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m composite.deploy",
        description=__doc__.split(":", 1)[1].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("push", "run"):
        s = sub.add_parser(name, allow_abbrev=False)
        s.add_argument("--transport", choices=["adb", "local"], default="adb")
        s.add_argument("--serial", help="adb device serial (needed when several are connected)")
        s.add_argument(
            "--device-dir", default=DEFAULT_DEVICE_DIR, help=f"folder on the device (default {DEFAULT_DEVICE_DIR})"
        )
        s.add_argument(
            "--local-root",
            default="device",
            help="--transport local: the folder standing in for the device (default ./device)",
        )
        if name == "push":
            s.add_argument("--artifacts", required=True, help="export folder (holds manifest.json)")
            s.add_argument(
                "--runner", help=f"runner binary (default {default_runner('adb')}; local: {default_runner('local')})"
            )
            s.add_argument(
                "--library-path",
                help="folders (':'-separated) to find the runner's shared libraries in, "
                "searched before its RUNPATH and the target's default folders",
            )
            s.add_argument("--eval-text", help="also push this text, for run --eval-text")
            s.add_argument("--kld-base", help="also push this kld-base file (composite.eval --kld-base-out)")
            s.add_argument(
                "--allow-qnn-mismatch",
                action="store_true",
                help="push QNN libraries of another version than the export's (refused by default)",
            )
        else:
            prompt = s.add_mutually_exclusive_group(required=True)
            prompt.add_argument("--prompt")
            prompt.add_argument("--prompt-ids", help="comma-separated token ids")
            prompt.add_argument("--chat", action="store_true", help="chat with user turns from stdin, one per line")
            prompt.add_argument(
                "--eval-text", help="perplexity on this text, pushed with push --eval-text (name or path)"
            )
            s.add_argument("--kld-base", help="with --eval-text: KLD against this pushed kld-base file")
            s.add_argument(
                "--stats-out",
                default="device_stats.json",
                help="where the pulled stats JSON goes (default device_stats.json)",
            )
    p.epilog = "run passes any other flag to composite_runner (e.g. --max_new_tokens 64 --temperature 0.8)."
    args, others = p.parse_known_args(argv)
    if args.command == "run" and args.kld_base and not args.eval_text:
        p.error("--kld-base is for --eval-text")
    if args.command == "run":
        args.runner_args = [a for a in others if a != "--"]
    elif others:
        p.error(f"unrecognized arguments: {' '.join(others)}")
    return args


@exits_cleanly
def main(argv=None) -> None:
    args = parse_args(argv)
    if args.command == "push":
        push(args)
    else:
        sys.exit(run(args))


if __name__ == "__main__":
    main()
