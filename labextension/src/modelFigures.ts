/**
 * The shared models' figures as the panel shows them (pure: no DOM, no JupyterLab; unit-tested).
 * The figures come from `GET /evalsched/models`; the notebook widget writes them the same way
 * (jupyter_evalsched/widget.py, `model_figures`).
 */
import type { IModelInfo } from './records';

/** Tokens per second: `0`, `8.5`, `1234`. */
export function formatRate(value: number | null | undefined): string {
  const v = Number(value ?? 0);
  if (!Number.isFinite(v) || v <= 0) {
    return '0';
  }
  return v < 100 ? v.toFixed(1) : v.toFixed(0);
}

/** The mean batch size with at most two decimals, trailing zeros dropped: `2.5`, `10`. */
export function formatBatch(value: number | null | undefined): string {
  const v = Number(value ?? 0);
  return Number.isFinite(v) ? String(Number(v.toFixed(2))) : '0';
}

/**
 * Where OpenAI's clients reach the shared models: the server's `endpoint` (what its runs get as
 * OPENAI_BASE_URL), else `<base URL>evalsched/v1` of the server this page talks to.
 */
export function modelEndpoint(
  model: Pick<IModelInfo, 'endpoint'>,
  baseUrl: string
): string {
  if (model.endpoint) {
    return model.endpoint;
  }
  return baseUrl.replace(/\/*$/, '/') + 'evalsched/v1';
}

/** A model list's shape check: what a server answered, or null when it is not a list. */
export function modelsOf(answer: unknown): IModelInfo[] | null {
  const models = (answer as { models?: unknown } | null)?.models;
  if (!Array.isArray(models)) {
    return null;
  }
  return models.filter(
    (m): m is IModelInfo =>
      !!m && typeof (m as { name?: unknown }).name === 'string'
  );
}

/** Whether what a row shows of two model lists is the same (the panel re-renders otherwise). */
export function sameModels(
  a: ReadonlyArray<IModelInfo>,
  b: ReadonlyArray<IModelInfo>
): boolean {
  return JSON.stringify(a) === JSON.stringify(b);
}
