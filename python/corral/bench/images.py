"""``corral bench images``: create latency of a sandbox on a pulled 10-layer OCI image against
the ``host`` image, in the same run, the systems taking turns op by op, cold creates (a
hostname no warm pool serves): with the layers as EROFS mounts (the session daemon) and as
plain directories (a daemon of its own, ``CORRAL_IMAGE_LAYERS=dir``); and the pulls, from a
docker-registry on loopback (started here, stopped after)."""

from __future__ import annotations

import shutil
import time
from typing import Any

from corral.bench import ocifix, sdk_runs
from corral.bench.daemon import PrivateDaemon
from corral.bench.results import OpResult
from corral.bench.session import Session
from corral.bench.stats import median, ratio

LAYERS = 10
SYSTEMS = ("host", "image", "image-dir", "image-40")


def image_layers(layers: int = LAYERS) -> list[tuple[str, list[ocifix.Member]]]:
    """busybox plus small layers, each adding a directory of files."""
    out: list[tuple[str, list[ocifix.Member]]] = [("gzip", ocifix.busybox_base())]
    for i in range(1, layers):
        files = [ocifix.d(f"opt/l{i}")] + [ocifix.f(f"opt/l{i}/f{j}", b"x" * 4096)
                                           for j in range(50)]
        out.append(("gzip" if i % 2 else "zstd", [ocifix.d("opt"), *files]))
    return out


BIG_LAYERS = 5


def big_layers(mb: int) -> list[tuple[str, list[ocifix.Member]]]:
    """A busybox base (its first command needs one) and five layers of ``mb`` / 5 MB of
    incompressible bytes each (gzip, as registries serve)."""
    return [("gzip", ocifix.busybox_base()), *(
        ("gzip", [ocifix.d("data"), ocifix.rand(f"data/blob{i}", (mb << 20) // BIG_LAYERS, i)])
        for i in range(BIG_LAYERS))]


def _skopeo_and_tar(ref: str, work: str) -> float:
    """ms for what a pull replaces: ``skopeo copy`` to a local dir, then ``tar -x`` of every
    layer into one tree."""
    import json
    import os
    import subprocess

    t0 = time.perf_counter()
    d, root = os.path.join(work, "skopeo-dir"), os.path.join(work, "root")
    os.makedirs(root)
    subprocess.run(["skopeo", "copy", "--quiet", "--src-tls-verify=false",
                    "--insecure-policy", f"docker://{ref}", f"dir:{d}"], check=True,
                   capture_output=True, env={**os.environ, "HOME": work})
    with open(os.path.join(d, "manifest.json")) as f:
        layers = json.load(f)["layers"]
    for lay in layers:
        subprocess.run(["tar", "-xzf", os.path.join(d, lay["digest"].split(":")[1]), "-C",
                        root], check=True)
    return (time.perf_counter() - t0) * 1000


def _pulls(s: Session, reg: ocifix.Registry, endpoints: dict[str, str]) -> dict[str, Any]:
    """An image of --image-mb MB: corral's pull (EROFS and directory layers, each from an
    empty store) against skopeo copy + tar, in the same run, medians of the runs; and the
    time to the first command on a cold node (the first endpoint's, its store empty):
    ``Sandbox(image=ref)``, which pulls, then its first exec."""
    import tempfile

    from corral.sdk import Sandbox, admin

    mb = s.opts.image_mb
    reg.push(ocifix.oci_layout("bench-big", big_layers(mb)), "bench/big")
    ref = f"{reg.addr}/bench/big:latest"
    times: dict[str, list[float]] = {k: [] for k in (*endpoints, "skopeo+tar")}
    first: list[float] = []
    for r in range(s.opts.runs):
        with s.ui.task(f"images {r + 1}/{s.opts.runs} pull of {mb} MB", None):
            for name, e in endpoints.items():
                t0 = time.perf_counter()
                admin.pull_image(ref, endpoint=e)
                times[name].append((time.perf_counter() - t0) * 1000)
                admin.remove_image(ref, endpoint=e)
            cold = next(iter(endpoints.values()))
            t0 = time.perf_counter()
            with Sandbox(ref, endpoint=cold, timeout=600) as sb:
                sb.exec(["true"]).check()
                first.append((time.perf_counter() - t0) * 1000)
            admin.remove_image(ref, endpoint=cold)
            work = tempfile.mkdtemp(prefix="skopeo-", dir=str(s.root))
            try:
                times["skopeo+tar"].append(_skopeo_and_tar(ref, work))
            finally:
                shutil.rmtree(work, ignore_errors=True)
    med = {k: _round(median(v)) for k, v in times.items()}
    return {"mb": mb, "layers": BIG_LAYERS + 1, "median_ms": med,
            "first_command_cold_ms": _round(median(first)),
            "ratios": {f"{k}/skopeo+tar": _round(ratio(med[k], med["skopeo+tar"]))
                       for k in endpoints}}


def images(s: Session) -> tuple[dict[str, Any], dict[str, Any]]:
    from corral.sdk import admin

    n, R = s.opts.n("images"), s.opts.runs
    missing = [t for t in ("docker-registry", "skopeo", "mkfs.erofs") if not shutil.which(t)]
    if missing:
        return {"skipped": f"needs {', '.join(missing)} (scripts/setup.sh)", "n": n,
                "median": {}, "ratios": {}, "runs": []}, {}
    ep = s.daemon.endpoint
    layout = ocifix.oci_layout("bench10", image_layers())
    runs: list[dict[str, OpResult]] = []
    # the same image with its layers as plain directories, on a daemon of its own
    dird = PrivateDaemon(s.root / "images-dir", f"{s.prefix}img-dir", 100,
                         env={"CORRAL_IMAGE_LAYERS": "dir", **s.registry_env})
    pull_ms: dict[str, float] = {}
    try:
        dird.start()
        with ocifix.registry(port=s.registry_port) as reg:
            reg.push(layout, "bench/ten")
            reg.push(ocifix.oci_layout("bench40", image_layers(40)), "bench/forty")
            ref = f"{reg.addr}/bench/ten:latest"
            ref40 = f"{reg.addr}/bench/forty:latest"
            refs = {"image": ref, "image-dir": ref, "image-40": ref40}
            for name, e in (("image", ep), ("image-dir", dird.endpoint), ("image-40", ep)):
                t0 = time.perf_counter()
                admin.pull_image(refs[name], endpoint=e)
                pull_ms[name] = (time.perf_counter() - t0) * 1000
            systems = {name: (dird.endpoint if name == "image-dir" else ep,
                              refs.get(name, "host")) for name in SYSTEMS}
            for r in range(R):
                with s.ui.task(f"images {r + 1}/{R} create/exec/destroy, systems in turn",
                               n) as adv:
                    runs.append(sdk_runs.latency_interleaved(systems, n, adv,
                                                             hostname="bench-images"))
            # memory per live sandbox, host vs the 10-layer image, same daemon
            from corral.bench.scenarios import _density_corral

            live = 5 * n
            density = {name: _density_corral(s, live, f"images density {name}",
                                             image=img)[0]
                       for name, img in (("host", "host"), ("image", ref))}
            for r_ in (ref, ref40):
                admin.remove_image(r_, endpoint=ep)
            admin.remove_image(ref, endpoint=dird.endpoint)
            big = _pulls(s, reg, {"corral-erofs": ep, "corral-dir": dird.endpoint})
    finally:
        dird.stop()
    med: dict[str, Any] = {}
    for name in SYSTEMS:
        med[name] = {f"{ph}_p50_ms": _round(median([median(res[name].phases.get(ph, []))
                                                    for res in runs]))
                     for ph in ("create", "first_exec", "ttfr", "destroy")}
    ratios = {f"{img}/host {ph}_p50": _round(median([
        ratio(median(res[img].phases.get(ph, [])), median(res["host"].phases.get(ph, [])))
        for res in runs])) for img in ("image", "image-dir", "image-40")
        for ph in ("create", "ttfr")}
    keys = ("kib_per_sandbox", "memcg_kib_per_sandbox", "memcg_nocache_kib_per_sandbox",
            "init_pss_kib", "create_s", "made")
    sec = {"n": n, "layers": LAYERS, "pull_big": big,
           "density": {k: {m: v.get(m) for m in keys} for k, v in density.items()},
           "pull_ms": {k: _round(v) for k, v in pull_ms.items()},
           "median": med, "ratios": ratios,
           "runs": [{k: v.to_json() for k, v in res.items()} for res in runs]}
    return sec, {}


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 3)
