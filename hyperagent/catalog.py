"""Help text of every metric hyperagent exposes. Rules and dashboards rely on these names.

Each source module keeps the help of its own metrics next to the code that makes them; this
merges them with the agent's and coordinator's own.
"""

from __future__ import annotations

from hyperagent import attribution
from hyperagent.devices import metrics as gpu
from hyperagent.sources import ipmi, pdu, rdma

_CORE: dict[str, str] = {
    # GPUs: every vendor's readings are named in hyperagent.devices.metrics.HELP
    "hyperagent_gpu_quantum_coefficient": (
        'Compute quanta one fully busy GPU of this model is worth (A100 = 1); known="false"'
        " marks a model indicators.quantum_coefficients does not name, counted as 1."
    ),
    # Host (procfs)
    "hyperagent_host_cpu_utilization_ratio": "Fraction of CPU time not idle, all cores.",
    "hyperagent_host_memory_total_bytes": "Physical memory installed.",
    "hyperagent_host_memory_available_bytes": "Memory available without swapping.",
    "hyperagent_host_swap_used_bytes": "Swap space in use.",
    "hyperagent_host_swap_total_bytes": "Swap space configured.",
    "hyperagent_host_swap_pages_total": "Pages swapped in or out since boot (/proc/vmstat).",
    "hyperagent_host_memory_pressure_stall_seconds_total": (
        "Time some task (some) or every non-idle task (full) stalled waiting for memory"
        " (/proc/pressure/memory)."
    ),
    "hyperagent_host_numa_balancing_mode": (
        "kernel.numa_balancing: 0 off, 1 automatic NUMA migration, 2 memory tiering."
    ),
    # Training job step reports
    "hyperagent_job_steps_total": "Training steps reported by the job on this node.",
    "hyperagent_job_samples_total": "Samples processed by the job on this node.",
    "hyperagent_job_step_seconds_total": (
        "Wall time of the reported steps, summed over the job's ranks on this node (over"
        " hyperagent_job_steps_total: one rank's mean step time)."
    ),
    "hyperagent_job_compute_seconds_total": "Compute time of the reported steps.",
    "hyperagent_job_communication_seconds_total": (
        "Exposed communication time of the reported steps."
    ),
    "hyperagent_job_loss": "Loss of the last reported step.",
    "hyperagent_job_nonfinite_loss_total": "Steps that reported a NaN or infinite loss.",
    "hyperagent_job_settings_version": "Settings version the agent last applied for the job.",
    "hyperagent_job_invalid_reports_total": "Job-socket messages dropped as invalid.",
    "hyperagent_job_refused_total": (
        "Job-socket peers or messages refused, by reason (unauthorised user, job id claimed by "
        "another user, report for a job or rank the connection did not claim, too many jobs, "
        "ranks or connections)."
    ),
    "hyperagent_job_ranks": "Ranks of the job connected to this node's agent.",
    "hyperagent_job_reporting_ranks": (
        "Connected ranks of the job whose steps are counted on this node (the node's step time"
        " is the step seconds' increase over this)."
    ),
    "hyperagent_job_rank_step_seconds": (
        "Step time of one rank: the mean over the connected ranks of their last step."
    ),
    # Job allocator reports (memory pressure, method="reported")
    "hyperagent_job_gpu_memory_allocated_ratio": (
        "Allocated over total bytes of the fullest GPU among the job's ranks on this node."
    ),
    "hyperagent_job_alloc_retries_total": (
        "GPU allocations the job's caching allocator retried after freeing its cache."
    ),
    "hyperagent_job_oom_total": "GPU allocations of the job that failed out of memory.",
    # Indicators
    "hyperagent_qu_ratio": "Quantum utilisation: sum(q_i u_i) / sum(q_i) over the GPUs.",
    "hyperagent_ccr_ratio": (
        "Communication/compute time ratio: reported over the job's last whole steps (held"
        " between them), or estimated from RDMA traffic over the last cycle."
    ),
    "hyperagent_memory_pressure_ratio": (
        "Memory pressure index: max of GPU and host memory pressure; method reported (the job's"
        " allocator) or estimated (NVML used fraction)."
    ),
    "hyperagent_compute_entropy_ratio": (
        "Normalised compute entropy H/ln N of the quantum-weighted load (1 = perfectly even)."
    ),
    "hyperagent_quantum_dispersion_ratio": (
        "Coefficient of variation of q_i u_i; above 0.7 load balancing is needed."
    ),
    "hyperagent_energy_per_sample_joules": (
        "GPU energy per training sample over the job's last whole steps (held between them)."
    ),
    # Self-monitoring
    "hyperagent_source_up": (
        "1 when the source's last read succeeded and no read is overdue (in flight past its"
        " timeout)."
    ),
    "hyperagent_source_duration_seconds": "Duration of the source's last read.",
    "hyperagent_source_errors_total": "Failed reads of the source.",
    "hyperagent_source_last_success_timestamp_seconds": (
        "Unix time of the source's last successful read (stops advancing while it fails)."
    ),
    "hyperagent_agent_last_collection_timestamp_seconds": (
        "Unix time of the agent's last collection cycle (stops advancing when the loop stalls;"
        " /metrics then serves that cycle's snapshot)."
    ),
    "hyperagent_device_call_failures_total": (
        "Calls into a device library (NVML) that timed out (reason timeout) or were refused at"
        " once because another call had hung past its timeout (reason busy)."
    ),
    "hyperagent_mqtt_connected": "1 while connected to the MQTT broker.",
    "hyperagent_mqtt_broker_info": "The address of mqtt.url connected to (while connected).",
    "hyperagent_mqtt_gate_open": (
        "1 while the agent's spooled reports and acks may go out (the coordinator online)."
    ),
    "hyperagent_mqtt_dropped_total": "Outgoing MQTT messages dropped because the outbox was full.",
    "hyperagent_mqtt_queued_messages": "Outgoing MQTT messages waiting (telemetry and spooled).",
    "hyperagent_mqtt_invalid_payloads_total": "Incoming MQTT payloads that failed validation.",
    "hyperagent_mqtt_handler_errors_total": (
        "Incoming MQTT messages whose handler failed, by subscription filter (each distinct"
        " error is logged once)."
    ),
    "hyperagent_settings_rejected_total": "Settings messages the agent refused, by reason.",
    "hyperagent_settings_applied_total": "Settings versions the agent applied.",
    "hyperagent_reports_sent_total": "Measurement reports sent (each once, resends aside).",
    "hyperagent_reports_resent_total": (
        "Measurement reports sent again because the coordinator had not confirmed them."
    ),
    "hyperagent_reports_unconfirmed": "Measurement reports the coordinator has not confirmed yet.",
    # Coordinator
    "hyperagent_coordinator_invalid_payloads_total": "MQTT payloads the coordinator dropped.",
    "hyperagent_coordinator_jobs": (
        "Jobs the coordinator holds, by lifecycle state (waiting_for_ranks, searching,"
        " confirming, tuned, retuning, paused, waiting_for_quorum, ended, failed)."
    ),
    "hyperagent_coordinator_jobs_found_total": (
        "Jobs found in the agents' telemetry and taken to tune."
    ),
    "hyperagent_coordinator_jobs_not_tuned": (
        "Jobs with ranks attached that the coordinator does not tune (its policy, or"
        " coordinator.max_jobs), each said once in its log."
    ),
    "hyperagent_coordinator_foreign_sightings_total": (
        "Nodes seen carrying a job's id under another uid than its owner's, or not among the"
        " scheduler's nodes of the job: not part of the job (each logged once)."
    ),
    "hyperagent_node_online": "1 while the node's retained MQTT status says online.",
    "hyperagent_node_status_timestamp_seconds": "Unix time of the node's last status message.",
    "hyperagent_tuner_settings_version": "Version of the settings last published for the job.",
    "hyperagent_tuner_rounds_total": "Tuning rounds of the job (a re-tune on drift starts one).",
    "hyperagent_tuner_trial_deadline_seconds": (
        "How long a trial may take: the ack and measurement time-outs together."
    ),
    "hyperagent_tuner_lost_nodes": "Nodes of the job excluded from scoring (offline or silent).",
    "hyperagent_tuner_nodes": "Nodes the job's tuning runs on (the nodes that carry it).",
    "hyperagent_tuner_recommended_setting": (
        "Numeric knob the recommend mode would set (bucket, chunk, cap)."
    ),
    "hyperagent_tuner_done": "1 once the job's tuning finished and its best settings went out.",
    "hyperagent_tuner_trials_total": "Finished trials of the job, by outcome.",
    "hyperagent_tuner_trials_stopped_early_total": (
        "Search trials of the job whose measurement stopped early, by verdict against the best"
        " trial before them (worse, better)."
    ),
    "hyperagent_tuner_baseline_score": "Score of the job's starting settings (higher is better).",
    "hyperagent_tuner_best_score": "Best score measured so far for the job.",
    "hyperagent_tuner_last_score": "Score of the job's last measured trial.",
    "hyperagent_tuner_tuning_seconds": "Wall time of the job's tuning round so far (its trials).",
    "hyperagent_tuner_samples_lost": (
        "Samples the tuning round lost against running its start settings for the same time "
        "(energy: for the same energy); negative when it trained more."
    ),
    "hyperagent_tuner_samples_lost_ratio": (
        "hyperagent_tuner_samples_lost over the samples the start settings would have trained."
    ),
    "hyperagent_tuner_break_even_seconds": (
        "Seconds at the chosen settings that win the lost samples back (absent: never)."
    ),
    "hyperagent_tuner_trial_started_timestamp_seconds": (
        "Unix time the running trial's settings went out."
    ),
    "hyperagent_tuner_setting": "Numeric knob of the settings last published (bucket, chunk, cap).",
    "hyperagent_tuner_allreduce_info": "AllReduce algorithm of the settings last published.",
    "hyperagent_tuner_state": (
        "1 for the job's lifecycle state (searching, confirming, paused, waiting_for_quorum,"
        " tuned, retuning, ...)."
    ),
    "hyperagent_tuner_paused": "1 while the job's tuning is paused, by reason.",
    "hyperagent_tuner_paused_node": "1 for each node the job's pause names.",
    "hyperagent_tuner_retry_timestamp_seconds": "Unix time the paused job is tried again.",
    "hyperagent_tuner_retries_total": "Runs of a paused job tried again (not trials).",
}


HELP: dict[str, str] = {
    **_CORE,
    **attribution.HELP,
    **gpu.HELP,
    **ipmi.HELP,
    **rdma.HELP,
    **pdu.HELP,
}


def help_text(name: str) -> str:
    """Help of a metric; a name missing from the catalogue is described by itself."""
    return HELP.get(name) or name.replace("_", " ")
