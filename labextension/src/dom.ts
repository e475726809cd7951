/**
 * Small DOM pieces shared by the panel's components.
 */
import { h } from './format';

/** Put `nodes` into `list` in this order (moving, not rebuilding), and drop the rest. */
export function reconcile(list: HTMLElement, nodes: HTMLElement[]): void {
  nodes.forEach((node, index) => {
    if (list.children[index] !== node) {
      list.insertBefore(node, list.children[index] ?? null);
    }
  });
  while (list.children.length > nodes.length) {
    list.lastElementChild!.remove();
  }
}

/** A progress bar: a fill, a label, and the ARIA values of a progressbar. */
export class ProgressBar {
  constructor(testid: string) {
    this._fill = h('div', { className: 'jp-EvalSched-progressFill' });
    this._label = h('span', { className: 'jp-EvalSched-progressLabel' });
    this.node = h(
      'div',
      {
        className: 'jp-EvalSched-progress',
        attrs: {
          role: 'progressbar',
          'aria-valuemin': '0',
          'data-testid': testid
        }
      },
      [this._fill, this._label]
    );
  }

  readonly node: HTMLElement;

  set(done: number, total: number, label: string): void {
    const pct = total > 0 ? Math.min(100, (100 * done) / total) : 0;
    this._fill.style.width = `${pct}%`;
    this._label.textContent = label;
    this.node.setAttribute('aria-valuenow', String(done));
    this.node.setAttribute('aria-valuemax', String(total));
  }

  private _fill: HTMLElement;
  private _label: HTMLElement;
}
