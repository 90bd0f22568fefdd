"""node-problem-detector's custom-plugin monitor configuration as a JSON schema.

Transcribed from kubernetes/node-problem-detector (commit 6632ca67):
pkg/custompluginmonitor/types/config.go (CustomPluginConfig, pluginGlobalConfig,
ApplyConfiguration, Validate), pkg/custompluginmonitor/types/types.go (CustomRule) and
pkg/types/types.go (Condition; Type "temporary"/"permanent"). Go's encoding/json
ignores unknown fields, so `additionalProperties: false` is stricter than NPD: it
catches a misspelt key that NPD would silently drop. What Validate() checks beyond the
shape (plugin "custom", durations that parse and are > 0, a rule timeout not above the
global one, a permanent rule's condition among the defaults, the path existing) is
checked by `npd_semantic_errors`.
"""

from __future__ import annotations

import re
from typing import Any

# time.ParseDuration: a sequence of decimal numbers with units (ns us µs ms s m h).
GO_DURATION = r"^([0-9]+(\.[0-9]*)?(ns|us|µs|ms|s|m|h))+$"

SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["plugin", "source", "conditions", "rules"],
    "additionalProperties": False,
    "properties": {
        "plugin": {"const": "custom"},
        "pluginConfig": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "invoke_interval": {"type": "string", "pattern": GO_DURATION},
                "timeout": {"type": "string", "pattern": GO_DURATION},
                "max_output_length": {"type": "integer", "minimum": 1},
                "concurrency": {"type": "integer", "minimum": 1},
                "enable_message_change_based_condition_update": {"type": "boolean"},
                "skip_initial_status": {"type": "boolean"},
            },
        },
        "source": {"type": "string", "minLength": 1},
        "metricsReporting": {"type": "boolean"},
        "conditions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "reason", "message"],
                "additionalProperties": False,
                "properties": {
                    "type": {"type": "string", "minLength": 1},
                    "reason": {"type": "string", "minLength": 1},
                    "message": {"type": "string"},
                },
            },
        },
        "rules": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["type", "reason", "path"],
                "additionalProperties": False,
                "properties": {
                    "type": {"enum": ["temporary", "permanent"]},
                    "condition": {"type": "string"},
                    "reason": {"type": "string", "minLength": 1},
                    "path": {"type": "string", "minLength": 1},
                    "args": {"type": "array", "items": {"type": "string"}},
                    "timeout": {"type": "string", "pattern": GO_DURATION},
                    "invoke_interval": {"type": "string", "pattern": GO_DURATION},
                },
            },
        },
    },
}

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def seconds(duration: str) -> float:
    return sum(
        float(n) * _UNITS[u] for n, u in re.findall(r"([0-9.]+)(ns|us|µs|ms|s|m|h)", duration)
    )


def npd_semantic_errors(cfg: dict[str, Any]) -> list[str]:
    """What CustomPluginConfig.Validate() rejects, with NPD's defaults applied."""
    errors = []
    glob = cfg.get("pluginConfig", {})
    interval = seconds(glob.get("invoke_interval", "30s"))
    timeout = seconds(glob.get("timeout", "5s"))
    if interval <= 0:
        errors.append("global invoke interval must be greater than zero")
    defaults = {c["type"] for c in cfg["conditions"]}
    for rule in cfg["rules"]:
        if "invoke_interval" in rule and seconds(rule["invoke_interval"]) <= 0:
            errors.append(f"rule invoke interval must be greater than zero: {rule}")
        if "timeout" in rule and seconds(rule["timeout"]) > timeout:
            errors.append(f"plugin timeout is greater than global timeout: {rule}")
        if rule["type"] == "permanent" and rule.get("condition") not in defaults:
            errors.append(f"permanent problem {rule.get('condition')} has no default condition")
    return errors
