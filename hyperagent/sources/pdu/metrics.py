"""The PDU source's metric names, their help texts and the unit factors profiles use."""

from __future__ import annotations

PDU_INFO = "hyperagent_pdu_info"
INLET_POWER = "hyperagent_pdu_inlet_power_watts"
INLET_CURRENT = "hyperagent_pdu_inlet_current_amperes"
INLET_VOLTAGE = "hyperagent_pdu_inlet_voltage_volts"
INLET_ENERGY = "hyperagent_pdu_inlet_energy_joules_total"
PHASE_POWER = "hyperagent_pdu_phase_power_watts"
PHASE_CURRENT = "hyperagent_pdu_phase_current_amperes"
PHASE_VOLTAGE = "hyperagent_pdu_phase_voltage_volts"
OUTLET_INFO = "hyperagent_pdu_outlet_info"
OUTLET_POWER = "hyperagent_pdu_outlet_power_watts"
OUTLET_CURRENT = "hyperagent_pdu_outlet_current_amperes"
OUTLET_VOLTAGE = "hyperagent_pdu_outlet_voltage_volts"
OUTLET_ENERGY = "hyperagent_pdu_outlet_energy_joules_total"
NODE_POWER = "hyperagent_pdu_node_power_watts"
NODE_ENERGY = "hyperagent_pdu_node_energy_joules_total"
SENSOR_POWER = "hyperagent_pdu_sensor_power_watts"
SENSOR_CURRENT = "hyperagent_pdu_sensor_current_amperes"
SENSOR_VOLTAGE = "hyperagent_pdu_sensor_voltage_volts"
SENSOR_TEMPERATURE = "hyperagent_pdu_sensor_temperature_celsius"

HELP: dict[str, str] = {
    PDU_INFO: (
        "PDU identity: vendor profile, the PDU's own name, model, serial number, firmware and "
        "sysObjectID (vendor unknown: no profile knows its MIB)."
    ),
    INLET_POWER: "Active power drawn through a PDU inlet (input cord).",
    INLET_CURRENT: "RMS current through a single-phase PDU inlet.",
    INLET_VOLTAGE: "RMS voltage at a single-phase PDU inlet.",
    INLET_ENERGY: "Energy drawn through a PDU inlet since the PDU's meter was last reset.",
    PHASE_POWER: "Active power on one phase of a PDU inlet.",
    PHASE_CURRENT: "RMS current on one phase or line conductor of a PDU inlet.",
    PHASE_VOLTAGE: "RMS voltage of one phase of a PDU inlet.",
    OUTLET_INFO: "Name an operator gave a PDU outlet.",
    OUTLET_POWER: "Active power drawn from a PDU outlet.",
    OUTLET_CURRENT: "RMS current drawn from a PDU outlet.",
    OUTLET_VOLTAGE: "RMS voltage at a PDU outlet.",
    OUTLET_ENERGY: "Energy drawn from a PDU outlet since the PDU's meter was last reset.",
    NODE_POWER: "Wall power of this node: the sum of its configured outlets on this PDU.",
    NODE_ENERGY: "Energy drawn by this node: the sum of its configured outlets' meters.",
    SENSOR_POWER: "Power reported by an ENTITY-SENSOR-MIB sensor of a PDU.",
    SENSOR_CURRENT: "Current reported by an ENTITY-SENSOR-MIB sensor of a PDU.",
    SENSOR_VOLTAGE: "Voltage reported by an ENTITY-SENSOR-MIB sensor of a PDU.",
    SENSOR_TEMPERATURE: "Temperature reported by an ENTITY-SENSOR-MIB sensor of a PDU.",
}

MEASUREMENTS = frozenset(HELP) - {PDU_INFO, OUTLET_INFO, NODE_POWER, NODE_ENERGY}
"""Metrics that carry a measured value (not identity, not this node's sums)."""

JOULES_PER_WH = 3600
JOULES_PER_TENTH_KWH = 360_000
JOULES_PER_KWH = 3_600_000
