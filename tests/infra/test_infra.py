"""infra/ and the Dockerfile stay consistent with each other and with the project.

Fast and offline: no Docker engine, Kubernetes cluster or network is needed.  Where a tool is
installed (`docker compose`, `kubectl` for `kubectl kustomize`) it is used too; otherwise those
checks skip.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
COMPOSE = INFRA / "docker-compose.yaml"
COMPOSE_GPU = INFRA / "docker-compose.gpu.yaml"
ENV_EXAMPLE = INFRA / ".env.example"
K8S = INFRA / "k8s"
DOCKERFILE = ROOT / "Dockerfile"

SERVICES = {"postgres", "minio", "minio-init", "mlflow", "prefect-server", "prefect-worker"}
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|AUTH|ACCESS_KEY|PRIVATE", re.I)  # never literal in compose
SECRET_VALUE = re.compile(r"PASSWORD|SECRET|TOKEN|AUTH", re.I)  # must be placeholders in .env.example
VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")
LOOPBACK = "127.0.0.1"


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[re.sub(r"[-_.]+", "-", name.split("[")[0]).lower()] = version.strip()
    return pins


CONSTRAINTS = _pins(ROOT / "constraints.txt")
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def _load(path: Path):
    return yaml.safe_load(path.read_text())


def _env_example() -> dict[str, str]:
    env = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose-style interpolation: ${V}, ${V:-d}, ${V-d}, ${V:?e}, ${V?e}, $V and $$."""

    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3)
        value = env.get(name)
        if op == ":-":
            return value if value else arg
        if op == "-":
            return arg if value is None else value
        if op in (":?", "?") and (value is None or (op == ":?" and not value)):
            raise KeyError(f"required variable {name} is not set: {arg}")
        return value or ""

    parts = text.split("$$")
    return "$".join(VAR.sub(one, part) for part in parts)


def _compose_vars(text: str) -> set[str]:
    return {m.group(1) or m.group(4) for m in VAR.finditer(text.replace("$$", ""))}


def _environment(service: dict) -> dict[str, object]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return env


def _walk_strings(node):
    if isinstance(node, dict):
        for v in node.values():
            yield from _walk_strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk_strings(v)
    elif isinstance(node, str):
        yield node


# ----------------------------------------------------------------------------- every YAML file

YAMLS = sorted(p for p in INFRA.rglob("*") if p.suffix in (".yaml", ".yml"))


def test_infra_has_yaml_files():
    names = {p.relative_to(INFRA).as_posix() for p in YAMLS}
    assert {"docker-compose.yaml", "ray/cluster.yaml", "k8s/raycluster.yaml", "k8s/rayjob.yaml"} <= names


@pytest.mark.parametrize("path", YAMLS, ids=[p.relative_to(INFRA).as_posix() for p in YAMLS])
def test_yaml_parses(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs and all(isinstance(d, dict) for d in docs)


# ----------------------------------------------------------------------------- docker compose


@pytest.fixture(scope="module")
def compose() -> dict:
    return _load(COMPOSE)


def test_compose_services_present(compose):
    assert SERVICES <= set(compose["services"])
    assert compose["name"] == "specdraft"


def test_compose_override_only_touches_known_services():
    gpu = _load(COMPOSE_GPU)
    assert set(gpu["services"]) == {"prefect-worker"}
    devices = gpu["services"]["prefect-worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


def _published(compose: dict):
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            yield name, port


def test_every_published_port_binds_loopback(compose):
    published = list(_published(compose))
    assert {name for name, _ in published} >= {"prefect-server", "mlflow", "minio"}
    for name, port in published:
        if isinstance(port, dict):  # long syntax
            host_ip = str(port.get("host_ip", ""))
        else:
            # HOST_IP:HOST_PORT:CONTAINER_PORT, where HOST_IP may itself be ${BIND_ADDR:-...}
            m = re.fullmatch(r"(\$\{[^}]+\}|[\d.]+):(\$\{[^}]+\}|\d+):(\d+)(/\w+)?", str(port))
            assert m, f"{name}: port {port!r} is not bound to an address"
            host_ip = m.group(1)
        assert host_ip in (LOOPBACK, "${BIND_ADDR:-127.0.0.1}"), f"{name}: {port!r}"
        # and with nothing configured, and with the example env, it is loopback
        assert interpolate(host_ip, {}) == LOOPBACK
        assert interpolate(host_ip, _env_example()) == LOOPBACK
    assert "ports" not in compose["services"]["postgres"]


def test_long_running_services_have_healthchecks(compose):
    for name, svc in compose["services"].items():
        if svc.get("restart") == "no":  # one-shot: others wait for it to complete
            waiters = [s for s in compose["services"].values()
                       if (s.get("depends_on") or {}).get(name, {}).get("condition") == "service_completed_successfully"]
            assert waiters, f"nothing waits for one-shot {name}"
            continue
        check = svc.get("healthcheck") or {}
        assert check.get("test") and not check.get("disable"), f"{name} has no healthcheck"


def test_dependencies_wait_for_health(compose):
    services = compose["services"]
    for name, svc in services.items():
        deps = svc.get("depends_on") or {}
        assert isinstance(deps, dict), f"{name}: depends_on needs conditions"
        for dep, spec in deps.items():
            assert dep in services
            cond = spec["condition"]
            if cond == "service_healthy":
                assert services[dep].get("healthcheck"), f"{name} waits on {dep}, which has no healthcheck"
            else:
                assert cond == "service_completed_successfully"


def test_named_volumes_declared(compose):
    declared = set(compose.get("volumes") or {})
    used = set()
    for svc in compose["services"].values():
        for vol in svc.get("volumes", []):
            src = vol.split(":", 1)[0] if isinstance(vol, str) else vol.get("source", "")
            if src and not src.startswith((".", "/", "~", "$")):
                used.add(src)
    assert used and used <= declared
    assert {"postgres-data", "minio-data"} <= used


def test_no_literal_secrets_in_compose(compose):
    for name, svc in compose["services"].items():
        for key, value in _environment(svc).items():
            if SECRET_NAME.search(key):
                assert isinstance(value, str) and re.fullmatch(r"\$\{[A-Z0-9_]+(:?\?[^}]*)?\}", value), (
                    f"{name}: {key} must be a required ${{VAR}} reference, got {value!r}")
    text = COMPOSE.read_text()
    # no credentials inside URLs, and no secret variable with a default value
    assert not re.search(r"://[^/\s:@$]+:[^/\s@]+@", text)
    for m in VAR.finditer(text.replace("$$", "")):
        if m.group(1) and SECRET_NAME.search(m.group(1)):
            assert m.group(2) in (None, ":?", "?"), f"secret {m.group(1)} has a default"
    # the worker gets the Prefect client auth, and the worker pool is the one prefect.yaml uses
    worker = compose["services"]["prefect-worker"]
    assert "PREFECT_API_AUTH_STRING" in _environment(worker)
    assert "specdraft-process" in " ".join(worker["command"])


def test_env_example_covers_compose_variables():
    env = _env_example()
    used = _compose_vars(COMPOSE.read_text()) | _compose_vars(COMPOSE_GPU.read_text())
    assert used, "compose file references no variables?"
    assert not used - set(env), f".env.example lacks {sorted(used - set(env))}"
    # compose's .env parser and others disagree on inline comments: keep them on their own lines
    assert not [k for k, v in env.items() if " #" in v]
    # ... and holds no real secret: every secret-looking value is a placeholder
    for key, value in env.items():
        if SECRET_VALUE.search(key):
            assert "change-me" in value, f"{key} in .env.example must be a change-me placeholder"


def test_compose_resolves_with_example_env(compose):
    env = _env_example()
    resolved = yaml.safe_load(interpolate(COMPOSE.read_text(), env))
    assert set(resolved["services"]) == set(compose["services"])
    with pytest.raises(KeyError, match="POSTGRES_PASSWORD"):
        interpolate(COMPOSE.read_text(), {k: v for k, v in env.items() if k != "POSTGRES_PASSWORD"})
    worker = resolved["services"]["prefect-worker"]
    assert worker["image"] == f"specdraft:{VERSION}"
    assert worker["environment"]["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    assert worker["environment"]["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"


def test_env_files_stay_private():
    assert ".env" in (INFRA / ".gitignore").read_text().split()
    dockerignore = (ROOT / ".dockerignore").read_text().split()
    assert "**/.env" in dockerignore and "runs" in dockerignore
    if shutil.which("git") and (ROOT / ".git").exists():
        ignored = subprocess.run(["git", "check-ignore", "-q", "infra/.env"], cwd=ROOT)
        kept = subprocess.run(["git", "check-ignore", "-q", "infra/.env.example"], cwd=ROOT)
        assert ignored.returncode == 0 and kept.returncode == 1


def test_gen_env_replaces_every_placeholder(tmp_path):
    sys.path.insert(0, str(INFRA))
    try:
        import gen_env
    finally:
        sys.path.remove(str(INFRA))
    out = tmp_path / ".env"
    assert gen_env.main(["--out", str(out)]) == 0
    text = out.read_text()
    values = [line for line in text.splitlines() if not line.startswith("#")]
    assert not any("change-me" in line for line in values)
    assert (out.stat().st_mode & 0o777) == 0o600
    assert set(_env_example()) == {line.split("=", 1)[0] for line in values if "=" in line}
    assert gen_env.main(["--out", str(out)]) == 1  # never overwrites silently


def _docker_compose_available() -> bool:
    if not shutil.which("docker"):
        return False
    try:
        return subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=15).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _docker_compose_available(), reason="`docker compose` is not installed here")
def test_docker_compose_config_is_valid():
    cmd = ["docker", "compose", "--env-file", str(ENV_EXAMPLE), "-f", str(COMPOSE), "-f", str(COMPOSE_GPU),
           "config", "-q"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 0, res.stderr


# ----------------------------------------------------------------------------- Dockerfile


def _readme_setup() -> str:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks, "README has no bash block"
    return blocks[0]


def _run_lines(dockerfile: str) -> str:
    return dockerfile.replace("\\\n", " ")


def test_dockerfile_installs_like_the_readme():
    setup = _readme_setup()
    torch = re.search(r"pip install torch==(\S+)", setup)
    project = re.search(r'pip install -c constraints\.txt -e "\.\[([\w,-]+)\]"', setup)
    assert torch and project, f"README set-up line changed shape: {setup!r}"
    docker = _run_lines(DOCKERFILE.read_text())
    # same torch pin as the README and constraints.txt
    assert re.search(rf"pip install torch=={re.escape(torch.group(1))}(\s|$)", docker)
    assert torch.group(1) == CONSTRAINTS["torch"]
    # same `pip install -c constraints.txt -e ".[extra]"` form, with the gpu extra
    assert 'pip install -c constraints.txt -e ".[gpu]"' in docker
    assert "gpu" in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    # torch goes in before the project (README order)
    assert docker.index("pip install torch==") < docker.index('pip install -c constraints.txt -e ".[gpu]"')


def test_dockerfile_image_shape():
    text = DOCKERFILE.read_text()
    froms = re.findall(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?", text, re.M)
    final_image, _ = froms[-1]
    assert final_image.startswith("nvidia/cuda:") and "-runtime-" in final_image
    assert re.search(r"^ENTRYPOINT \[\"specdraft\"\]$", text, re.M)
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    assert re.search(r"^ARG WITH_FLASH_ATTN=", text, re.M)  # flash-attn can be skipped
    assert re.search(r"^ARG PYTHON_VERSION=3\.(11|12)$", text, re.M)


def test_dockerfile_copies_existing_paths_not_dockerignored():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith(("#", "!"))}
    for line in _run_lines(DOCKERFILE.read_text()).splitlines():
        parts = line.split()
        if not parts or parts[0] != "COPY" or any(p.startswith("--from") for p in parts):
            continue
        for src in [p for p in parts[1:-1] if not p.startswith("--")]:
            assert (ROOT / src).exists(), f"COPY {src}: no such file"
            assert src.split("/")[0] not in ignored, f"COPY {src} is excluded by .dockerignore"


def test_cluster_requirements_agree_with_constraints():
    cluster = _pins(INFRA / "docker" / "requirements-cluster.txt")
    assert cluster["ray"] == CONSTRAINTS["ray"]
    clash = {k: (v, CONSTRAINTS[k]) for k, v in cluster.items() if k in CONSTRAINTS and CONSTRAINTS[k] != v}
    assert not clash
    mlflow_docker = (INFRA / "mlflow" / "Dockerfile").read_text()
    assert f"ARG MLFLOW_VERSION={CONSTRAINTS['mlflow']}" in mlflow_docker
    compose_text = COMPOSE.read_text()
    assert f"prefecthq/prefect:{CONSTRAINTS['prefect']}-python" in compose_text
    assert f"specdraft-mlflow:{CONSTRAINTS['mlflow']}" in compose_text


# ----------------------------------------------------------------------------- Ray


IMAGE = f"ghcr.io/your-org/specdraft:{VERSION}"


def test_ray_cluster_launcher_config_is_valid():
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = _load(INFRA / "ray" / "cluster.yaml")
    validate_config(cfg)  # Ray's own schema (ray-schema.json)
    validate_config(prepare_config(cfg))
    assert cfg["docker"]["image"] == IMAGE
    # the image's entrypoint is `specdraft`; the launcher runs `<image> bash`
    assert any(o.startswith("--entrypoint") for o in cfg["docker"]["run_options"])
    assert cfg["head_node_type"] in cfg["available_node_types"]
    head = " ".join(cfg["head_start_ray_commands"])
    assert "ray start --head" in head and "--ray-client-server-port=10001" in head


def _containers(pod_template: dict) -> list[dict]:
    return pod_template["spec"]["containers"]


def test_raycluster_manifest():
    rc = _load(K8S / "raycluster.yaml")
    assert (rc["apiVersion"], rc["kind"]) == ("ray.io/v1", "RayCluster")
    assert rc["spec"]["rayVersion"] == CONSTRAINTS["ray"]
    head = _containers(rc["spec"]["headGroupSpec"]["template"])
    assert [c["image"] for c in head] == [IMAGE]
    assert {p["containerPort"] for p in head[0]["ports"]} >= {6379, 8265, 10001}
    assert rc["spec"]["headGroupSpec"]["serviceType"] == "ClusterIP"
    groups = rc["spec"]["workerGroupSpecs"]
    assert groups
    for group in groups:
        (worker,) = _containers(group["template"])
        assert worker["image"] == IMAGE
        assert int(worker["resources"]["limits"]["nvidia.com/gpu"]) >= 1
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    for template in [rc["spec"]["headGroupSpec"]["template"]] + [g["template"] for g in groups]:
        assert template["spec"]["securityContext"]["runAsNonRoot"] is True


def test_rayjob_manifest():
    job = _load(K8S / "rayjob.yaml")
    rc = _load(K8S / "raycluster.yaml")
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    entry = job["spec"]["entrypoint"]
    assert entry.startswith("specdraft run --config ") and "ray.address=auto" in entry.split()
    config = entry.split()[3]
    assert config.startswith("/opt/specdraft/configs/")  # baked into the image (Dockerfile COPY configs)
    assert (ROOT / "configs" / Path(config).name).is_file(), f"{config} is not a shipped config"
    assert job["spec"]["clusterSelector"]["ray.io/cluster"] == rc["metadata"]["name"]
    assert [c["image"] for c in _containers(job["spec"]["submitterPodTemplate"])] == [IMAGE]


def test_kustomization_resources_exist():
    kz = _load(K8S / "kustomization.yaml")
    assert kz["namespace"] == "specdraft"
    for res in kz["resources"]:
        assert (K8S / res).is_file()
    assert "rayjob.yaml" not in kz["resources"]  # runs are created one by one
    by_name = {i["name"]: i for i in kz["images"]}
    assert by_name[IMAGE.split(":")[0]]["newTag"] == VERSION


def test_configs_point_at_the_cluster_services():
    """Addresses in the shipped run configs match the names the manifests create."""
    rc = _load(K8S / "raycluster.yaml")
    kz = _load(K8S / "kustomization.yaml")
    services = {d["metadata"]["name"] for d in yaml.safe_load_all((K8S / "mlflow.yaml").read_text())
                if d["kind"] == "Service"}
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        text = path.read_text()
        for m in re.finditer(r"ray://([a-z0-9-]+)-head-svc(?:\.[a-z0-9-]+)*:(\d+)", text):
            assert m.group(1) == rc["metadata"]["name"] and m.group(2) == "10001", path.name
        for m in re.finditer(r"http://([a-z0-9-]+)\.([a-z0-9-]+)\.svc(?:\.cluster\.local)?:(\d+)", text):
            assert m.group(1) in services and m.group(2) == kz["namespace"] and m.group(3) == "5000", path.name


def test_every_k8s_image_is_the_project_image():
    images = set()
    for path in K8S.glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") != "Kustomization":
                images |= {s for s in _walk_strings(doc) if s.startswith("ghcr.io/")}
    assert images == {IMAGE, f"ghcr.io/your-org/specdraft-mlflow:{CONSTRAINTS['mlflow']}"}


@pytest.mark.skipif(not shutil.which("kubectl"), reason="kubectl is not installed here")
def test_kustomize_build():
    res = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "KUBECONFIG": os.devnull})
    assert res.returncode == 0, res.stderr
    docs = [d for d in yaml.safe_load_all(res.stdout) if d]
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("Namespace", "specdraft"), ("RayCluster", "raycluster-specdraft"), ("Service", "mlflow"),
            ("PersistentVolumeClaim", "specdraft-data"), ("ServiceAccount", "specdraft")} <= kinds
    for d in docs:
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == "specdraft"
