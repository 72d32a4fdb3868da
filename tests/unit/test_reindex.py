"""Incremental selection, prompt rendering, manifest format."""
import orjson
import pytest

from nightshift.jobs.schedules.reindex import (TemplateRenderError, build_manifest, check_prompt_template,
                                               content_hash, manifest_key, output_key, render_body,
                                               request_line, select_changed)


def test_select_changed_new_modified_unchanged_removed():
    indexed = {"a.txt": content_hash(b"A"), "b.txt": content_hash(b"B"), "gone.txt": "x"}
    current = {"a.txt": content_hash(b"A"), "b.txt": content_hash(b"B2"), "c.txt": content_hash(b"C")}
    sel = select_changed(current, indexed)
    assert sel.changed == ["b.txt", "c.txt"]
    assert sel.unchanged == ["a.txt"]
    assert sel.removed == ["gone.txt"]
    assert select_changed(current, current).changed == []


def test_render_body_and_request_line():
    template = {"messages": [{"role": "user", "content": "Summarize {{ key }}:\n{{ document }}"}],
                "max_tokens": 32}
    body = render_body(template, document="hello {{ not a template }}", key="doc/1.txt")
    assert body == {"messages": [{"role": "user",
                                  "content": "Summarize doc/1.txt:\nhello {{ not a template }}"}],
                    "max_tokens": 32}
    line = orjson.loads(request_line(custom_id="doc/1.txt", endpoint="/v1/chat/completions",
                                     body=body, model="default"))
    assert line == {"custom_id": "doc/1.txt", "method": "POST", "url": "/v1/chat/completions",
                    "body": {**body, "model": "default"}}


def test_template_errors_name_the_field():
    with pytest.raises(TemplateRenderError, match=r"prompt_template.messages\[0\].content"):
        check_prompt_template({"messages": [{"content": "{{ document "}]})
    with pytest.raises(TemplateRenderError, match="'doc'"):
        render_body({"prompt": "{{ doc }}"}, document="x", key="doc")
    with pytest.raises(TemplateRenderError, match="JSON object"):
        check_prompt_template("just a string")


def test_keys_and_manifest_format():
    assert output_key("index/v1", "a/b.txt") == "index/v1/a/b.txt.json"
    assert manifest_key("/index/v1/") == "index/v1/_manifest.json"
    manifest = orjson.loads(build_manifest(
        schedule_id="sched_1", index_prefix="index/v1", updated_at=100,
        last_run={"id": "run_1"},
        documents={"b": {"sha256": "2"}, "a": {"sha256": "1"}}))
    assert manifest["index_prefix"] == "index/v1/"
    assert list(manifest["documents"]) == ["a", "b"]
    assert manifest["document_count"] == 2
    assert manifest["last_run"] == {"id": "run_1"}
