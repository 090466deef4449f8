"""The one reader of vLLM's /metrics text (`nodeagent.vllm.promtext`): what its four readers rely on."""

from __future__ import annotations

import pytest

from nodeagent.vllm.promtext import MetricsTextError, Sample, samples

PAGE = r"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="dsv4"} 2.0
vllm:num_requests_running 1 1700000000000
http_requests_total{handler="/v1/chat/completions",status="5xx"} 6.0
odd{path="a}b",quote="say \"hi\"",back="c:\\d",nl="x\ny"} +Inf
vllm:iteration_tokens_total_bucket{engine="0",le="+Inf"} 611.0
"""


def test_samples_by_name_with_their_labels_unescaped() -> None:
    assert list(samples(PAGE, {"vllm:num_requests_running"})) == [
        Sample("vllm:num_requests_running", {"engine": "0", "model_name": "dsv4"}, 2.0),
        Sample("vllm:num_requests_running", {}, 1.0),
    ]
    (odd,) = samples(PAGE, {"odd"})
    assert odd.labels == {"path": "a}b", "quote": 'say "hi"', "back": "c:\\d", "nl": "x\ny"}
    assert odd.value == float("inf")
    assert len(list(samples(PAGE))) == 5, "every sample without names"


def test_a_foreign_page_reads_as_nothing_unless_strict() -> None:
    html = "<html><body>404 Not Found</body></html>\nInternal Server Error\n"
    assert list(samples(html, {"vllm:num_requests_running"})) == []
    with pytest.raises(MetricsTextError, match="line 1 has no number"):
        list(samples(html, {"vllm:num_requests_running"}, strict=True))
    with pytest.raises(MetricsTextError, match="Internal has no number"):
        list(samples("Internal Server Error\n", strict=True))
    assert list(samples("", strict=True)) == [] and list(samples("# only a comment\n\n", strict=True)) == []


def test_a_wanted_sample_without_a_number_is_an_error_a_foreign_one_is_skipped() -> None:
    with pytest.raises(MetricsTextError, match="vllm:num_requests_running has no number"):
        list(samples('vllm:num_requests_running{engine="0"} lots\n', {"vllm:num_requests_running"}))
    with pytest.raises(MetricsTextError):
        list(samples('vllm:num_requests_running{engine="0"\n', {"vllm:num_requests_running"}))  # cut short
    assert list(samples("other lots\n", {"vllm:num_requests_running"})) == []
