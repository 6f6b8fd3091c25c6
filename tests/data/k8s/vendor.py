"""Regenerate the two trimmed schemas in this folder (README.md says from which commits).

    python tests/data/k8s/vendor.py CRD_YAML SWAGGER_JSON

CRD_YAML: kubeflow/mpi-operator's manifests/base/kubeflow.org_mpijobs.yaml; SWAGGER_JSON:
kubernetes-client/python's kubernetes/swagger.json.unprocessed. Descriptions are dropped (90% of the
bytes); every other keyword is kept as published, except that the swagger's Quantity and IntOrString
(``type: string`` there, although the API server also takes a number) become
``x-kubernetes-int-or-string``, the CRD's spelling of the same rule.
"""
import json
import sys

import yaml

ROOT_DEFINITION = "io.k8s.api.core.v1.PodTemplateSpec"
INT_OR_STRING = ("io.k8s.apimachinery.pkg.api.resource.Quantity", "io.k8s.apimachinery.pkg.util.intstr.IntOrString")


def strip(node, in_properties=False):
    """``node`` without ``description`` keywords (a property that is named "description" stays)."""
    if isinstance(node, dict):
        return {k: strip(v, k == "properties" and not in_properties) for k, v in node.items()
                if in_properties or k != "description"}
    if isinstance(node, list):
        return [strip(x) for x in node]
    return node


def references(node):
    """Definition names that ``node`` refers to (``$ref: #/definitions/NAME``)."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref":
                yield v.rsplit("/", 1)[-1]
            else:
                yield from references(v)
    elif isinstance(node, list):
        for x in node:
            yield from references(x)


def main(crd_path: str, swagger_path: str) -> None:
    crd = yaml.safe_load(open(crd_path, encoding="utf-8"))
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v2beta1")
    with open("tests/data/k8s/mpijob-v2beta1.schema.json", "w", encoding="utf-8") as f:
        json.dump(strip(version["schema"]["openAPIV3Schema"]), f, sort_keys=True, separators=(",", ":"))
        f.write("\n")
    definitions = json.load(open(swagger_path, encoding="utf-8"))["definitions"]
    needed, todo = set(), [ROOT_DEFINITION]
    while todo:
        name = todo.pop()
        if name not in needed:
            needed.add(name)
            todo.extend(references(definitions[name]))
    trimmed = {name: strip(definitions[name]) for name in sorted(needed)}
    for name in INT_OR_STRING:
        trimmed[name] = {"x-kubernetes-int-or-string": True}
    with open("tests/data/k8s/core-v1-podtemplatespec.definitions.json", "w", encoding="utf-8") as f:
        json.dump({"root": ROOT_DEFINITION, "definitions": trimmed}, f, sort_keys=True, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
