"""containers/: the Kubernetes MPIJob is valid against the MPI Operator's CRD schema and the core PodTemplateSpec
schema (vendored in tests/data/k8s/, no cluster), its hpctrain command is a valid run whose ports, run
directory and /dev/shm agree with the pod spec, and the Containerfiles, the Apptainer definition and the
build script agree with each other (text checks; the image itself is built by containers/build_cpu_image.sh)."""
import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from hpctrain.config.layout import Layout
from hpctrain.config.load import load_config
from hpctrain.config.validation import validate

REPO = Path(__file__).resolve().parents[2]
CONTAINERS = REPO / "containers"
SCHEMAS = REPO / "tests" / "data" / "k8s"
MANIFEST = CONTAINERS / "k8s" / "mpijob.yaml"
INT32 = (-(1 << 31), (1 << 31) - 1)
TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "integer": int, "number": (int, float)}


def schema_errors(value, schema: dict, where: str = "", definitions: dict | None = None) -> list[str]:
    """Where ``value`` breaks ``schema``: the subset of OpenAPI v3 / JSON Schema that Kubernetes' schemas use
    (type, format int32/int64, properties, required, additionalProperties, items, enum, pattern, anyOf, $ref,
    x-kubernetes-int-or-string). A field no schema declares is an error, as with `kubectl --validate=strict`."""
    if "$ref" in schema:
        return schema_errors(value, definitions[schema["$ref"].rsplit("/", 1)[-1]], where, definitions)
    where = where or "<root>"
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            return [f"{where}: {value!r} is neither an integer nor a string"]
    elif "type" in schema:
        expected = TYPES[schema["type"]]
        if isinstance(value, bool) and schema["type"] != "boolean" or not isinstance(value, expected):
            return [f"{where}: {value!r} is not of type {schema['type']}"]
    if "anyOf" in schema and all(schema_errors(value, s, where, definitions) for s in schema["anyOf"]):
        return [f"{where}: {value!r} matches none of {schema['anyOf']}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{where}: {value!r} is not one of {schema['enum']}"]
    if schema.get("format") == "int32" and isinstance(value, int) and not INT32[0] <= value <= INT32[1]:
        return [f"{where}: {value} is out of the int32 range"]
    if "pattern" in schema and isinstance(value, str) and not re.search(schema["pattern"], value):
        return [f"{where}: {value!r} does not match {schema['pattern']!r}"]
    errors = []
    if isinstance(value, dict):
        properties, extra = schema.get("properties", {}), schema.get("additionalProperties")
        errors += [f"{where}: required field {name!r} is missing" for name in schema.get("required", ())
                   if name not in value]
        for name, item in value.items():
            if name in properties:
                errors += schema_errors(item, properties[name], f"{where}.{name}", definitions)
            elif isinstance(extra, dict):
                errors += schema_errors(item, extra, f"{where}.{name}", definitions)
            elif properties and extra is not True and not schema.get("x-kubernetes-preserve-unknown-fields"):
                errors.append(f"{where}: unknown field {name!r}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{where}[{i}]", definitions)
    return errors


def mpijob_schema() -> dict:
    return json.loads((SCHEMAS / "mpijob-v2beta1.schema.json").read_text())


def pod_template_schema() -> tuple[dict, dict]:
    core = json.loads((SCHEMAS / "core-v1-podtemplatespec.definitions.json").read_text())
    return {"$ref": f"#/definitions/{core['root']}"}, core["definitions"]


def manifest_errors(manifest: dict) -> list[str]:
    """Errors against the CRD, then against the core schema for each replica's pod template."""
    errors = schema_errors(manifest, mpijob_schema())
    root, definitions = pod_template_schema()
    for role, replica in manifest.get("spec", {}).get("mpiReplicaSpecs", {}).items():
        if isinstance(replica, dict) and "template" in replica:
            errors += schema_errors(replica["template"], root, f"{role}.template", definitions)
    return errors


@pytest.fixture(scope="module")
def manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def test_the_mpijob_is_valid_against_the_crd_and_core_schemas(manifest):
    assert manifest["apiVersion"] == "kubeflow.org/v2beta1" and manifest["kind"] == "MPIJob"
    assert set(manifest["spec"]["mpiReplicaSpecs"]) == {"Launcher", "Worker"}
    assert manifest_errors(manifest) == []


def _set(manifest: dict, path: str, value) -> dict:
    """A copy of ``manifest`` with the dotted ``path`` (list indices as numbers) set; value None deletes it."""
    broken = copy.deepcopy(manifest)
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node = broken
    for p in parents:
        node = node[p]
    if value is None:
        del node[last]
    else:
        node[last] = value
    return broken


WORKER = "spec.mpiReplicaSpecs.Worker"
WORKER_CONTAINER = f"{WORKER}.template.spec.containers.0"


@pytest.mark.parametrize("path, value, expected", [
    (f"{WORKER}.replicas", "two", "Worker.replicas: 'two' is not of type integer"),
    ("spec.slotsPerWorker", 1 << 40, "slotsPerWorker: 1099511627776 is out of the int32 range"),
    ("spec.mpiImplementation", "MVAPICH", "is not one of ['OpenMPI', 'Intel', 'MPICH']"),
    ("spec.mpiReplicaSpecs", None, "required field 'mpiReplicaSpecs' is missing"),
    (f"{WORKER_CONTAINER}.ports.0.containerPort", "2222", "containerPort: '2222' is not of type integer"),
    (f"{WORKER_CONTAINER}.name", None, "required field 'name' is missing"),
    (f"{WORKER_CONTAINER}.args", "-De", "args: '-De' is not of type array"),
    (f"{WORKER_CONTAINER}.volumeMount", [], "unknown field 'volumeMount'"),
    (f"{WORKER}.template.spec.volumes.1.emptyDir.sizeLimit", 2.5, "sizeLimit: 2.5 is neither an integer nor a string"),
    (f"{WORKER}.template.metadata.annotations.prometheus.io/port", 9400, "prometheus.io/port: 9400 is not of type string"),
])
def test_a_broken_manifest_fails_validation(manifest, path, value, expected):
    if path.endswith("prometheus.io/port"):  # a key with dots: set it directly
        broken = copy.deepcopy(manifest)
        broken["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["metadata"]["annotations"]["prometheus.io/port"] = value
    else:
        broken = _set(manifest, path, value)
    errors = manifest_errors(broken)
    assert any(expected in e for e in errors), errors


def test_each_schema_on_its_own_catches_a_broken_pod_template(manifest):
    """Both checks are live: the CRD's copy of the pod spec and the core schema each flag the same mistakes."""
    broken = _set(manifest, f"{WORKER_CONTAINER}.ports.0.containerPort", "2222")
    broken = _set(broken, f"{WORKER_CONTAINER}.imagePullPolice", "Always")
    root, definitions = pod_template_schema()
    crd = schema_errors(broken, mpijob_schema())
    core = schema_errors(broken["spec"]["mpiReplicaSpecs"]["Worker"]["template"], root, "t", definitions)
    for errors in (crd, core):
        assert len(errors) == 2 and any("'2222' is not of type integer" in e for e in errors), errors
        assert any("unknown field 'imagePullPolice'" in e for e in errors), errors


def _launch(manifest: dict) -> tuple[int, list[str]]:
    """(ranks, hpctrain train's overrides) of the launcher's `mpiexec -n N hpctrain train ...`."""
    launcher = manifest["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    argv = launcher["command"] + launcher["args"]
    assert argv[:2] == ["mpiexec", "-n"] and argv[3:5] == ["hpctrain", "train"], argv
    rest, overrides = argv[5:], []
    while rest:
        if rest[0].startswith("--"):
            rest = rest[2:]  # --resume auto
        else:
            overrides.append(rest.pop(0))
    return int(argv[2]), overrides


def test_the_mpijob_runs_a_valid_hpctrain_run_that_matches_its_pods(manifest):
    spec = manifest["spec"]
    ranks, overrides = _launch(manifest)
    workers = spec["mpiReplicaSpecs"]["Worker"]
    assert ranks == workers["replicas"] * spec["slotsPerWorker"]
    cfg = load_config(None, overrides)
    validate(cfg)
    Layout.from_config(cfg, ranks).validate()
    pod = workers["template"]
    container = pod["spec"]["containers"][0]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    # Prometheus: rank 0 listens on every interface at the annotated, declared port
    assert cfg.monitor.prometheus_addr == "0.0.0.0"
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(cfg.monitor.prometheus_port)
    assert cfg.monitor.prometheus_port in [p["containerPort"] for p in container["ports"]]
    # the run directory on the shared PVC, the local tier on a memory-backed /dev/shm
    runs = next(n for n, v in volumes.items() if "persistentVolumeClaim" in v)
    assert cfg.train.run_dir.startswith(mounts[runs] + "/")
    assert mounts["dshm"] == "/dev/shm" and volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert cfg.checkpoint.local_dir.startswith("/dev/shm/") and cfg.checkpoint.local_interval > 0
    # the workers' sshd is the image's (port and config file)
    ssh_port = int(re.search(r"ARG SSH_PORT=(\d+)", (CONTAINERS / "Containerfile").read_text()).group(1))
    assert container["readinessProbe"]["tcpSocket"]["port"] == ssh_port
    assert "/home/mpiuser/.sshd_config" in container["args"]
    assert spec["sshAuthMountPath"] == "/home/mpiuser/.ssh" and spec["mpiImplementation"] == "MPICH"


def _assignment(text: str, name: str) -> str:
    """The value of ``NAME=value`` (a shell assignment or a Containerfile ARG) in ``text``."""
    match = re.search(rf"^(?:ARG )?{name}=\"?\$?{{?(?:{name}:-)?([^\"}}\s]+)", text, re.M)
    assert match, f"{name}= not found"
    return match.group(1)


def test_the_build_script_the_containerfile_and_the_apptainer_definition_agree():
    script = (CONTAINERS / "build_cpu_image.sh").read_text()
    containerfile = (CONTAINERS / "Containerfile").read_text()
    definition = (CONTAINERS / "hpctrain.def").read_text()
    manifest = MANIFEST.read_text()
    assert script.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in script
    # the Apptainer definition builds from the archive the script writes, of the image it tags
    archive = _assignment(script, "ARCHIVE")
    assert re.search(r"^Bootstrap: oci-archive\nFrom: (\S+)$", definition, re.M).group(1) == archive
    image = _assignment(script, "IMAGE")
    assert f"image: {image}" in manifest and f"-t \"$IMAGE\"" in script
    # the image is built FROM the debootstrap base, with this checkout's wheel, offline
    assert re.search(r"^ARG BASE_IMAGE=.*\nFROM \$\{BASE_IMAGE\}$", containerfile, re.M)
    assert "--build-arg BASE_IMAGE=\"$BASE_IMAGE\"" in script and "--pull=never" in script
    assert "pip wheel --no-deps" in script and re.search(r"wheel=\$\(ls /tmp/wheels/hpctrain-\*\.whl\)", containerfile)
    assert '"${wheel}[${HPCTRAIN_EXTRAS}]"' in containerfile and "ARG HPCTRAIN_EXTRAS=mpi,monitor" in containerfile
    # whatever the Containerfile would fetch with apt, debootstrap already put in the base
    apt = re.search(r"apt-get install -y --no-install-recommends \\\n\s+(.+?) &&", containerfile).group(1).split()
    assert set(apt) <= set(_assignment(script, "PACKAGES").split(",")), apt
    # the CPU torch of the image is the one the project pins
    constraint = re.search(r"^torch==(\S+)", (REPO / "scripts" / "constraints.txt").read_text(), re.M).group(1)
    assert _assignment(containerfile, "TORCH_VERSION") == constraint


def test_the_cuda_recipe_pins_exact_versions_and_documents_them():
    cuda = (CONTAINERS / "Containerfile.cuda").read_text()
    docs = (REPO / "docs" / "containers.md").read_text()
    pins = {name: _assignment(cuda, name) for name in ("CUDA_VERSION", "TORCH_VERSION", "TORCH_INDEX", "CUPY_SPEC")}
    assert re.fullmatch(r"\d+\.\d+\.\d+", pins["CUDA_VERSION"]) and re.fullmatch(r"\d+\.\d+\.\d+", pins["TORCH_VERSION"])
    assert re.fullmatch(r"cupy-cuda\d+x==\d+\.\d+\.\d+", pins["CUPY_SPEC"])
    cuda_tag = "cu" + "".join(pins["CUDA_VERSION"].split(".")[:2])  # 13.0.0 -> cu130: torch built for this CUDA
    assert pins["TORCH_INDEX"].endswith("/" + cuda_tag)
    assert pins["CUPY_SPEC"].startswith(f"cupy-cuda{pins['CUDA_VERSION'].split('.')[0]}x")
    assert "FROM docker.io/nvidia/cuda:${CUDA_VERSION}-base-${UBUNTU}" in cuda
    assert '"${wheel}[${HPCTRAIN_EXTRAS}]"' in cuda
    for value in pins.values():
        assert value in docs, f"{value} (Containerfile.cuda) is not in docs/containers.md"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_build_script_parses_and_explains_itself():
    script = CONTAINERS / "build_cpu_image.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=30).returncode == 0
    usage = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=30)
    assert usage.returncode == 0 and "--oci-archive" in usage.stdout and "debootstrap" in usage.stdout
