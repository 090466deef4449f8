"""The fast tier (`-m fast`, `scripts/test.sh --fast`, before every commit): the tests that start no process and
wait on no real clock — the pure rules, the layers on `cluster_fakes`' virtual clock, the parsers.

The rule, applied by tests/conftest.py at collection (`is_fast`), from what a test is known by and never from a
mark kept in each test file (a file someone else edits): not `system`; none of `PROCESS_FIXTURES` among its
fixtures (pytest's closure: a fixture of a fixture counts); not in `NOT_FAST` (the modules, or single tests,
that start processes through their own helpers: a CLI run, a guide script in bash, the fake npu-smi, the
stand-in; or that wait on the wall clock). A rule kept by hand goes stale, so its process half is checked, not
claimed: from the first fixture a fast test sets up (a module's or the session's too) to its teardown, each way
to start a process is refused and recorded (conftest's `pytest_runtest_setup`), in the full run as well, so a new
test that starts one fails at once, naming the process, until it is listed here. The list was made that way: the
candidates run under that check, and what failed was listed. The wall clock cannot be checked so: the tests that
wait on it were found by their CPU time, a small fraction of their duration (`time.process_time` per test).
"""

from __future__ import annotations

import pytest

PROCESS_FIXTURES = frozenset({"local_agent", "stack", "etcd", "own_etcd", "listener", "fixed_ports"})
"""The shared fixtures that start processes (an agent, etcd, a listener) or wait on the machine's fixed ports."""

NOT_FAST: frozenset[str] = frozenset({
    "tests/test_cancellation.py::test_a_cancelled_engine_command_is_killed_with_its_children",
    "tests/test_cancellation.py::test_a_timed_out_engine_command_leaves_no_child_behind",
    "tests/test_cancellation.py::test_cancelling_the_container_task_ends_its_watch_and_the_events_child",
    "tests/test_config_checks.py::test_config_validate_exits_78_on_the_handshake_overlap",
    "tests/test_npu_monitor.py::test_durations_are_monotonic_and_a_faults_since_is_wall_time",
    "tests/test_preflight_container.py::test_the_shipped_configs_container_passes_on_a_ready_host",
    "tests/test_prober.py::test_a_wall_clock_step_does_not_stretch_the_initial_delay",
    "tests/test_proctable.py::test_a_scrape_reads_the_trees_usage_off_the_loop",
    "tests/test_proctable.py::test_a_stop_keeps_the_loop_responsive_on_a_slow_proc_and_ends_the_whole_tree",
    "tests/test_proctable.py::test_the_pass_reads_what_psutil_reads",
    "tests/test_proctable.py::test_the_table_finds_the_same_tree_as_before",
    "tests/test_proxy_pd.py::test_real_proxy_routes_through_prefill_then_decode",
    "tests/test_render_cluster.py::test_every_rank_matches_the_guide_launch",
    "tests/test_render_cluster.py::test_the_ranks_of_a_node_get_their_own_ports_and_npus",
    "tests/test_render_shipped_container.py",
    "tests/test_run.py",
    "tests/test_preflight.py::test_a_members_rows_name_it_and_its_ranks",
    "tests/test_preflight.py::test_the_shipped_cluster_file_warns_nothing_it_could_fix",
    "tests/test_api.py",
    "tests/test_bench.py::test_bad_arguments_and_unreachable_metrics",
    "tests/test_bench.py::test_bench_against_the_standin",
    "tests/test_bench.py::test_command_is_the_guides_script_flag_for_flag",
    "tests/test_bench.py::test_json_output_and_a_failing_client",
    "tests/test_bench.py::test_no_vllm_is_one_clear_line",
    "tests/test_bindrace.py::test_a_real_bind_error_is_recognised",
    "tests/test_cachewatch.py::test_ctrl_c_stops_cleanly",
    "tests/test_cli.py",
    "tests/test_fault_campaign.py::test_the_short_campaign_holds_every_check",
    "tests/test_cluster_package.py",
    "tests/test_config_reference.py::test_the_script_runs_standalone",
    "tests/test_caches.py::test_the_versions_are_read_by_the_interpreter_of_the_ranks_command",
    "tests/test_container_host.py::test_the_shell_reads_once_and_asks_podman_only_when_it_matters",
    "tests/test_container_mode.py::test_a_containers_shm_is_swept_by_the_paths_its_processes_see",
    "tests/test_discovery.py::test_node_never_reaches_another_clusters_agent",
    "tests/test_discovery.py::test_node_picks_among_agents_sharing_one_file",
    "tests/test_discovery.py::test_stale_reused_and_untrusted_announcements_are_ignored",
    "tests/test_discovery.py::test_the_cli_finds_the_running_agent",
    "tests/test_etcd_members.py::test_three_members_render_and_form_one_cluster",
    "tests/test_guards.py",
    "tests/test_journal.py::test_open_stream_header_and_child_output",
    "tests/test_ladder.py::test_fake_npu_smi_reset_clears_the_fault_of_every_chip",
    "tests/test_ladder.py::test_fake_npu_smi_reset_refused_while_busy_or_not_confirmed",
    "tests/test_layout.py::test_config_validate_and_render_errors_for_a_member",
    "tests/test_layout.py::test_every_node_renders_a_consistent_cluster",
    "tests/test_loadtime.py::test_a_real_agent_times_each_vllm_load_shows_the_time_left_and_keeps_the_history",
    "tests/test_start_phases.py::test_a_real_agent_shows_the_phase_of_a_loading_vllm_and_exports_each_phase",
    "tests/test_logsink.py::test_under_journald_a_component_runs_through_the_relay_with_or_without_a_scope",
    "tests/test_membership.py",
    "tests/test_metrics.py",
    "tests/test_mqtt.py::test_a_frozen_broker_does_not_slow_supervision",
    "tests/test_mqtt.py::test_broker_outage_loses_nothing_within_the_buffer",
    "tests/test_mqtt.py::test_every_event_in_order_and_the_retained_status_matches",
    "tests/test_mqtt.py::test_overflow_drops_the_oldest_and_says_how_many",
    "tests/test_mqtt.py::test_refused_credentials_are_explained_and_supervision_goes_on",
    "tests/test_mqtt.py::test_tls_with_a_ca_file",
    "tests/test_mqtt.py::test_without_agent_mqtt_no_mqtt_code_is_imported",
    "tests/test_npu.py::test_a_hung_tool_times_out_and_is_killed",
    "tests/test_npu.py::test_healthy_a2_snapshot_from_the_fakes",
    "tests/test_npu.py::test_processes_are_marked_visible_or_not",
    "tests/test_npu.py::test_sick_chip_gets_its_error_codes_and_a_failing_tool_is_an_error",
    "tests/test_npu_health.py::test_the_fake_scenarios_through_the_facade",
    "tests/test_npu_monitor.py::test_a_poll_begun_after_the_call_never_answers_with_a_reading_from_before",
    "tests/test_npu_monitor.py::test_fault_holds_start_emits_events_and_clears",
    "tests/test_npu_monitor.py::test_foreign_process_against_our_real_process_tree",
    "tests/test_npu_monitor.py::test_metrics_of_a_sick_host",
    "tests/test_npu_monitor.py::test_npu_probe_kind_in_a_role_and_the_node_default",
    "tests/test_npu_monitor.py::test_override_lets_the_start_through_and_says_so",
    "tests/test_packaging.py::test_product_wheel_has_no_standin",
    "tests/test_parallel.py",
    "tests/test_pd_watch.py::test_under_journald_the_relay_keeps_the_failure_lines_kvlog_counts",
    "tests/test_postmortem.py::test_a_bundle_holds_the_failed_runs_output_and_what_explains_it",
    "tests/test_postmortem.py::test_a_growing_core_is_waited_for_until_it_settles",
    "tests/test_postmortem.py::test_nodeagentctl_postmortem_list_and_show",
    "tests/test_preflight.py::test_64k_pages_warn",
    "tests/test_preflight.py::test_a_crashing_check_is_a_fail_not_a_crash",
    "tests/test_preflight.py::test_cann_too_old_and_missing",
    "tests/test_preflight.py::test_disk_space_short_of_the_logs_warns_then_fails",
    "tests/test_preflight.py::test_enable_huge_tlb_without_huge_pages_fails",
    "tests/test_preflight.py::test_healthy_a2_host_passes",
    "tests/test_preflight.py::test_nic_that_does_not_carry_node_ip_fails",
    "tests/test_preflight.py::test_old_hdk_with_rh2d_fails_and_without_passes",
    "tests/test_preflight.py::test_peers_seed_and_clock_skew",
    "tests/test_preflight.py::test_sick_npus_fail",
    "tests/test_preflight.py::test_truncated_and_missing_shards_fail",
    "tests/test_preflight.py::test_without_huge_tlb_the_guide_asks_for_it_and_memory_is_measured",
    "tests/test_preflight_container.py::test_a_host_without_npus_warns_naming_what_the_line_leaves_out",
    "tests/test_preflight_container.py::test_a_ready_host_passes_and_the_image_is_pulled_first",
    "tests/test_preflight_container.py::test_an_engine_that_does_not_answer_fails",
    "tests/test_preflight_container.py::test_an_npu_host_missing_devices_and_mount_sources_fails_with_the_run_args_that_drop_them",
    "tests/test_preflight_container.py::test_crun_refusing_the_cgroups_without_runc_fails",
    "tests/test_preflight_container.py::test_dscli_on_a_bind_mount_warns_with_the_faq_fix",
    "tests/test_preflight_container.py::test_mindcluster_container_manager_fails_unless_they_coexist",
    "tests/test_preflight_container.py::test_programs_inside_are_the_images_and_host_mode_skips",
    "tests/test_preflight_container.py::test_runtime_and_rlimits_adapted_to_the_host_are_said",
    "tests/test_prober.py::test_stop_kills_an_in_flight_probe",
    "tests/test_prober.py::test_timeout_is_a_failure_and_never_blocks_others",
    "tests/test_probes.py::test_datasystem_kv_no_worker",
    "tests/test_probes.py::test_datasystem_kv_wrong_python",
    "tests/test_probes.py::test_exec_exit_codes",
    "tests/test_probes.py::test_exec_timeout_kills_the_group",
    "tests/test_recovery_layer.py::test_the_fake_npu_smi_reset_answers_through_the_facade",
    "tests/test_render_cluster.py::test_internal_launch_matches_the_multi_node_tutorial",
    "tests/test_render_cluster.py::test_proxy_matches_proxy_sh",
    "tests/test_render_container.py::test_guide_defaults_are_the_sections_defaults",
    "tests/test_render_container.py::test_guide_script_equals_render",
    "tests/test_render_container.py::test_render_container_command_prints_the_run_line",
    "tests/test_render_container.py::test_render_container_shows_the_line_adapted_to_this_host",
    "tests/test_render_container.py::test_render_container_without_section_says_so",
    "tests/test_render_container.py::test_shell_runs_the_command_as_given",
    "tests/test_render_ft.py::test_every_flag_rendered_for_fault_tolerance_is_in_the_real_vllm_serve_help",
    "tests/test_render_ft.py::test_the_real_vllm_argparser_takes_the_rendered_command_line",
    "tests/test_render_golden.py",
    "tests/test_residue.py::test_a_live_named_semaphore_is_kept_though_its_name_is_mapped_nowhere",
    "tests/test_residue.py::test_clean_slate_of_a_dp_rank_looks_at_its_own_npus_only",
    "tests/test_residue.py::test_clean_slate_waits_for_hbm_back_to_its_idle_baseline",
    "tests/test_residue.py::test_kill_processes_finds_exactly_the_components_leftovers",
    "tests/test_residue.py::test_shm_segments_nobody_maps_are_removed",
    "tests/test_residue.py::test_the_configured_npu_smi_is_the_one_the_clean_slate_and_the_post_mortem_use",
    "tests/test_simulation.py",  # batches of simulated runs: seconds to minutes, not a pre-commit check
    "tests/test_sim_container.py",  # the container-mode simulation's planted bugs: a minute or two
    "tests/test_sim_pd.py",  # the PD watch's simulation and its planted bugs: a minute or two
    "tests/test_residue.py::test_wait_devices_free_reads_npu_smi",
    "tests/test_run_local.py",
    "tests/test_standin.py",
    "tests/test_systemd_unit.py::test_unit_verifies_without_output",
    "tests/test_systemd_unit.py::test_verify_does_catch_mistakes",
    "tests/test_tree_watch.py::test_the_lister_finds_the_titled_processes_of_a_real_tree_and_sees_one_die",
    "tests/test_ui.py::test_a_node_live_restarts_cache_rates_and_the_agent_going_away",
    "tests/test_ui.py::test_the_page_can_be_switched_off",
    "tests/test_vllm_ft.py",
    "tests/test_vllm_install.py::test_an_adopted_rank_knows_its_launch_left_the_flags_out",
    "tests/test_vllm_install.py::test_the_supervisor_launches_without_the_flags_and_its_view_says_why",
    "tests/test_vllm_progress.py::test_probe_fails_at_once_on_an_errored_engine_and_reports_refusals",
    "tests/test_vllm_progress.py::test_probe_on_an_idle_standin_sends_the_canary",
    "tests/test_vllm_progress.py::test_probe_under_load_judges_progress_and_catches_the_hang",
    "tests/test_warm_weights_system.py",
    "tests/test_weight_warm.py::test_the_reader_keeps_to_its_rate",
})  # fmt: skip
"""Modules (`tests/test_x.py`) and single tests (`tests/test_x.py::test_y`, every parametrization) outside the
fast tier: they start processes through their own helpers or fixtures, or wait on the wall clock (test_membership's
real sleeps, the post-mortem's settling core, `logs -f`, the FT client's stand-in server)."""


def is_fast(item: pytest.Item) -> bool:
    if item.get_closest_marker("system") is not None:
        return False
    if PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        return False
    module, _, name = item.nodeid.partition("::")
    return module not in NOT_FAST and f"{module}::{name.split('[')[0]}" not in NOT_FAST
