"""The judge's requests: `reward_model.template`, a Jinja template, rendered once per completion
over the row's columns plus `prompt`, `completion` and `reference` (the `reward_model.reference_column`
column, None where the row has none). Rendered in Jinja's sandbox with undefined names failing, so a
template that names a missing column stops the run instead of asking about an empty string."""

from __future__ import annotations

from typing import Any

from rltrain.runtime.errors import UserError


def compile_template(source: str) -> Any:
    """The template, compiled once; a syntax error is a UserError naming it."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise UserError(
            f"reward_model.template is not a valid Jinja template ({exc.message}, line {exc.lineno}). "
            "Fix it; it may use {{ prompt }}, {{ completion }}, {{ reference }} and any column of the data."
        ) from exc


def render_requests(
    template: Any, prompts: list[str], completions: list[str], columns: dict[str, list], reference_column: str | None
) -> list[str]:
    """One judge prompt per completion (`columns`: one value per completion, as reward functions get them)."""
    import jinja2

    texts = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        row = {name: values[i] for name, values in columns.items()}
        reference = row.get(reference_column) if reference_column else None
        try:
            texts.append(template.render(**row, prompt=prompt, completion=completion, reference=reference))
        except jinja2.UndefinedError as exc:
            raise UserError(
                f"reward_model.template names something the row does not have ({exc.message}); the row's "
                f"columns are {sorted(row)}, besides prompt, completion and reference. Fix the template "
                "or map the column with data.columns.*."
            ) from exc
    return texts
