"""GPU, intra-node link and network profiles (hardware.yaml, or a user's --hardware FILE.yaml of the same shape).

A profile file is read with yaml.safe_load (no tags, nothing executes) and checked key by key: an unknown key,
a missing one or a value that is not a positive number is a ConfigError naming the file, the entry and the fix.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ...config.yaml_errors import yaml_error_line
from ...errors import ConfigError

GB = 1e9
_GPU_KEYS: dict[str, type] = {
    "peak_tflops": float,
    "memory_gb": float,
    "hbm_tbps": float,
    "link": str,
    "gpus_per_node": int,
}
_LINK_KEYS: dict[str, type] = {"bandwidth_gbps": float, "latency_us": float}
_NETWORK_KEYS: dict[str, type] = {"nics": int, "gbit_per_nic": float, "latency_us": float}


@dataclass(frozen=True)
class Gpu:
    name: str
    peak_flops: float  # dense bf16 FLOP/s, the MFU denominator
    memory: float  # bytes
    hbm_bw: float  # bytes/s
    link: str
    gpus_per_node: int


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # bytes/s one way per GPU
    latency: float  # seconds per ring step


@dataclass(frozen=True)
class Network:
    name: str
    node_bandwidth: float  # bytes/s out of one node, all NICs together
    latency: float  # seconds per ring step across nodes


@dataclass(frozen=True)
class Hardware:
    gpu: Gpu
    link: Link
    network: Network
    gpus_per_node: int

    def nic_bandwidth_per_gpu(self) -> float:
        """A GPU's share of its node's network bandwidth (rail-optimised: every GPU drives its own NIC)."""
        return self.network.node_bandwidth / self.gpus_per_node

    def describe(self) -> str:
        n = self.network
        return (
            f"{self.gpu.name} ({self.gpu.peak_flops / 1e12:.0f} TFLOP/s bf16, {self.gpu.hbm_bw / 1e12:.2f} TB/s), "
            f"{self.gpus_per_node} per node over {self.link.name} ({self.link.bandwidth / GB:.0f} GB/s), "
            f"network {n.name} ({n.node_bandwidth / GB:.0f} GB/s per node, {n.latency * 1e6:.0f} us)"
        )


def _load_yaml(text: str, where: str) -> dict:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(yaml_error_line(where, e)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must hold a mapping with gpus:, links: and/or networks:")
    unknown = set(data) - {"gpus", "links", "networks"}
    if unknown:
        raise ConfigError(f"{where}: unknown section(s) {sorted(unknown)}; use gpus, links, networks")
    return data


def _entries(data: dict, section: str, keys: Mapping[str, type], where: str, partial: bool = False) -> dict:
    out = {}
    block = data.get(section) or {}
    if not isinstance(block, dict):
        raise ConfigError(f"{where}: {section} must map names to settings")
    for name, entry in block.items():
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: {section}.{name} must be a mapping of {sorted(keys)}")
        unknown, missing = set(entry) - set(keys), set(keys) - set(entry)
        if unknown:
            raise ConfigError(f"{where}: {section}.{name}: unknown key(s) {sorted(unknown)}; known: {sorted(keys)}")
        if missing and not partial:
            raise ConfigError(f"{where}: {section}.{name}: missing {sorted(missing)}")
        for key, value in entry.items():
            kind = keys[key]
            if kind is str:
                if not isinstance(value, str):
                    raise ConfigError(f"{where}: {section}.{name}.{key} must be a name, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= _LARGEST:
                raise ConfigError(
                    f"{where}: {section}.{name}.{key} must be a positive number (at most {_LARGEST:g}), got {value!r}"
                )
            elif kind is int and value != int(value):
                raise ConfigError(f"{where}: {section}.{name}.{key} must be a whole number, got {value!r}")
        out[str(name).lower()] = entry
    return out


@dataclass
class Profiles:
    gpus: dict[str, dict[str, Any]]
    links: dict[str, dict[str, Any]]
    networks: dict[str, dict[str, Any]]


@functools.cache
def _shipped_profiles() -> dict:
    """hardware.yaml, parsed once: the simulator resolves hardware for every run it simulates."""
    return _load_yaml(resources.files(__package__).joinpath("hardware.yaml").read_text(), "hardware.yaml")


def load_profiles(extra: str | Path | None = None) -> Profiles:
    """The shipped profiles, with those of `extra` (a --hardware YAML) added or replacing them by name."""
    data = copy.deepcopy(_shipped_profiles())  # a --hardware file's entries replace some of them
    profiles = Profiles(
        _entries(data, "gpus", _GPU_KEYS, "hardware.yaml"),
        _entries(data, "links", _LINK_KEYS, "hardware.yaml"),
        _entries(data, "networks", _NETWORK_KEYS, "hardware.yaml"),
    )
    if extra is not None:
        path = Path(extra)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"--hardware {path}: cannot read it ({e.strerror})") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"--hardware {path} is not UTF-8 text (byte {e.start}): save it as UTF-8 YAML") from None
        where = f"--hardware {path}"
        data = _load_yaml(text, where)
        profiles.gpus.update(_entries(data, "gpus", _GPU_KEYS, where))
        profiles.links.update(_entries(data, "links", _LINK_KEYS, where))
        profiles.networks.update(_entries(data, "networks", _NETWORK_KEYS, where))
        for name, gpu in profiles.gpus.items():
            if gpu["link"] not in profiles.links:
                raise ConfigError(
                    f"{where}: gpus.{name}.link {gpu['link']!r} is not a link; known: {sorted(profiles.links)}"
                )
    return profiles


# The largest number a hardware setting may be (a GPU of 1e9 TFLOP/s, a link of 1e9 GB/s): past it, a typo or an
# infinity, which would plan an infinitely fast GPU.
_LARGEST = 1e9

_NETWORK_SPEC = re.compile(r"(\d+)x(\d+(?:\.\d+)?)gb(?:-[a-z0-9]+)?", re.IGNORECASE)


def resolve_hardware(
    gpu: str = "h100-sxm",
    network: str | None = None,
    inter_node_bandwidth: float | None = None,
    inter_node_latency_us: float | None = None,
    gpus_per_node: int | None = None,
    hardware_file: str | Path | None = None,
) -> Hardware:
    """The hardware of a plan: a GPU profile, its link, and the network (a profile name, any 'NxRATEGb-kind'
    such as 8x400Gb-ndr, or --inter-node-bandwidth GB/s per GPU with --inter-node-latency)."""
    profiles = load_profiles(hardware_file)
    key = gpu.lower()
    if key not in profiles.gpus:
        raise ConfigError(
            f"--gpu {gpu!r} is not a known GPU; known: {', '.join(sorted(profiles.gpus))} (or --hardware FILE.yaml)"
        )
    g = profiles.gpus[key]
    per_node = gpus_per_node or int(g["gpus_per_node"])
    link = profiles.links[g["link"]]
    net = _network(profiles, network, inter_node_bandwidth, inter_node_latency_us, per_node)
    return Hardware(
        Gpu(key, g["peak_tflops"] * 1e12, g["memory_gb"] * GB, g["hbm_tbps"] * 1e12, g["link"], per_node),
        Link(g["link"], link["bandwidth_gbps"] * GB, link["latency_us"] * 1e-6),
        net,
        per_node,
    )


def _network(
    profiles: Profiles, name: str | None, bandwidth: float | None, latency_us: float | None, per_node: int
) -> Network:
    if bandwidth is not None:
        if not 0 < bandwidth <= _LARGEST:
            raise ConfigError(f"--inter-node-bandwidth {bandwidth} must be a positive number of GB/s per GPU")
        lat = 6.0 if latency_us is None else latency_us
        if not 0 <= lat <= _LARGEST:
            raise ConfigError(f"--inter-node-latency {lat} must be a finite number of microseconds >= 0")
        return Network(f"{bandwidth:g} GB/s per GPU", bandwidth * GB * per_node, lat * 1e-6)
    name = name or "8x400Gb-ndr"
    entry = profiles.networks.get(name.lower())
    if entry is None:
        match = _NETWORK_SPEC.fullmatch(name)
        if not match:
            raise ConfigError(
                f"--network {name!r}: give a profile ({', '.join(sorted(profiles.networks))}), NICSxRATEGb "
                "such as 8x400Gb-ndr, or --inter-node-bandwidth GB/s"
            )
        entry = {"nics": int(match.group(1)), "gbit_per_nic": float(match.group(2)), "latency_us": 6.0}
        if not (1 <= entry["nics"] <= 1024 and 0 < entry["gbit_per_nic"] <= _LARGEST):
            raise ConfigError(
                f"--network {name!r}: NICSxRATEGb needs 1 to 1024 NICs of a positive rate, e.g. 8x400Gb-ndr"
            )
    lat = entry["latency_us"] if latency_us is None else latency_us
    if not 0 <= lat <= _LARGEST:
        raise ConfigError(f"--inter-node-latency {lat} must be a finite number of microseconds >= 0")
    return Network(name, entry["nics"] * entry["gbit_per_nic"] * 1e9 / 8, lat * 1e-6)
