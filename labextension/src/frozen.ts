// Dashboards of a kernel that died without retiring them become static snapshots.
//
// A monarch dashboard is an ipywidget: its output in the notebook holds a reference to a
// widget model (mime `application/vnd.jupyter.widget-view+json`) plus the kernel's static
// text/html fallback. A kernel that shuts down cleanly replaces each dashboard output
// itself (monarch_kernel/widgets/retire.py: update_display_data before it exits). A
// SIGKILLed kernel (out-of-memory killer, a crash) writes nothing; what happens then
// (read from jupyter_server / jupyter_client, @jupyterlab/services 7 and
// @jupyter-widgets/jupyterlab-manager 5, and seen in tests/test_browser_killed.py):
//
//  1. jupyter_client's KernelRestarter (the server polls the kernel process every 3 s)
//     finds it dead, fires its `restart` callbacks (the server's websocket handler sends
//     an iopub `status: restarting` message) and starts a new process under the SAME
//     kernel id: the session's kernel connection stays, so `kernelChanged` never fires.
//  2. The page's KernelConnection gets that status: it emits statusChanged('restarting')
//     (the widget manager's disconnect(): every model's comm_live = false, restoredStatus
//     = false; the views stay in the DOM, showing stale tiles), then, in a microtask,
//     statusChanged('autorestarting'), drops its comms and reconnects its websocket.
//  3. connectionStatus 'connected': the widget manager's restoreWidgets() asks the new
//     kernel for its `jupyter.widget` comms (none) and marks itself restored; the old
//     models are not closed, so the stale views stay until the page is reloaded.
//  4. The new kernel reports 'starting', then 'idle'.
//  5. After a reload, the widget renderer cannot find the model: "Error displaying
//     widget: model not found" (a restart that fails instead ends in status 'dead').
//
// So: at the first sign of a death (status 'restarting', 'autorestarting' or 'dead', or a
// new kernel connection) the live dashboards are captured from the DOM at once (the views
// are still there; a clone of the `.mk-dash` node, its canvases turned into images).
// Once a kernel is up again (status 'idle' after that sign; or when a notebook is opened),
// the kernel is asked which widget comms it has, and every dashboard output that still
// holds the widget-view mime of a model the kernel does not know is replaced in the
// notebook MODEL (so it is saved and survives a reload) by its snapshot: the capture, or
// when none exists (the page was reloaded after the death) the kernel's own text/html
// fallback, under one line saying why. Outputs the kernel retired itself no longer hold
// the widget-view mime and are left alone, whichever order its update_display_data and
// the status change arrive in.

import { Kernel } from '@jupyterlab/services';
import { Widget } from '@lumino/widgets';

export const WIDGET_MIME = 'application/vnd.jupyter.widget-view+json';
const WIDGET_TARGET = 'jupyter.widget';

/** The largest snapshot (characters of HTML) a frozen dashboard leaves in the notebook;
 * past it the charts' images are left out (the kernel's retire.py bounds its own). */
export const MAX_SNAPSHOT_CHARS = 300_000;

/** What is used of an output's model (IOutputModel). */
interface IOutputLike {
  type: string;
  data: Record<string, unknown>;
}

/** What is used of a cell's outputs (IOutputAreaModel). */
interface IOutputsLike {
  length: number;
  get(index: number): IOutputLike;
  set(index: number, output: Record<string, unknown>): void;
}

/** What is used of a cell widget (a CodeCell has both). */
interface ICellLike {
  model: { outputs?: IOutputsLike };
  outputArea?: { widgets: readonly Widget[] };
}

/** A lumino signal, as far as it is used here. */
interface ISignalLike<T> {
  connect(fn: (sender: unknown, args: T) => void): unknown;
}

/** What is used of a notebook panel (the notebook package is not a dependency). */
export interface INotebookPanelLike {
  content: { widgets: readonly ICellLike[] };
  context?: { ready: Promise<void> };
  sessionContext: {
    session: { kernel: Kernel.IKernelConnection | null } | null;
    statusChanged: ISignalLike<Kernel.Status>;
    kernelChanged: ISignalLike<unknown>;
    ready: Promise<void>;
    isDisposed: boolean;
  };
}

/** One dashboard output still showing a widget view. */
interface IDashOutput {
  outputs: IOutputsLike;
  index: number;
  modelId: string;
  fallback: string; // the kernel's text/html snapshot
  text: string; // and its text/plain one
  mesh: string;
  detachable: boolean;
  host: HTMLElement | null; // where its view is rendered, if it is
}

/** `HH:MM:SS` of `when`. */
function clock(when: Date): string {
  return when.toTimeString().slice(0, 8);
}

/** The line above a frozen dashboard (`died`: when its kernel was seen dying; null when
 * it died before this page saw it). */
export function whyFrozen(mesh: string, detachable: boolean, died: Date | null): string {
  const head = died
    ? `The kernel that showed this dashboard died at ${clock(died)}`
    : 'The kernel that showed this dashboard is gone';
  if (detachable) {
    return (
      `${head}; mesh '${mesh}' is detachable and may run on without it: ` +
      `run %mesh attach ${mesh} to see it live again. Its last state:`
    );
  }
  return `${head}, and its mesh '${mesh}' with it. Its last state:`;
}

/** A static copy of the live dashboard rendered under `host`, or null if none is: the
 * `.mk-dash` node cloned, its canvases (charts) as images unless `images` is false,
 * its buttons as plain boxes (same classes, so the same look; nothing to click). */
export function captureView(host: HTMLElement, images = true): string | null {
  const live = host.querySelector<HTMLElement>('.mk-dash');
  if (!live) {
    return null;
  }
  const copy = live.cloneNode(true) as HTMLElement;
  const canvases = live.querySelectorAll('canvas');
  copy.querySelectorAll('canvas').forEach((canvas, i) => {
    const src = canvases[i];
    let url = '';
    if (images && src && src.width > 0 && src.height > 0) {
      try {
        url = src.toDataURL('image/png');
      } catch {
        url = ''; // a tainted canvas: left out
      }
    }
    if (!url) {
      canvas.remove();
      return;
    }
    const img = document.createElement('img');
    img.src = url;
    img.className = canvas.className;
    img.alt = 'chart';
    img.style.cssText = src.style.cssText;
    img.style.width = `${src.clientWidth || src.width}px`;
    img.style.height = `${src.clientHeight || src.height}px`;
    canvas.replaceWith(img);
  });
  copy.querySelectorAll('button').forEach(button => {
    const box = document.createElement('div');
    box.className = button.className;
    box.setAttribute('style', button.getAttribute('style') ?? '');
    box.title = button.title;
    box.style.cursor = 'default';
    if (!button.classList.contains('mk-tile')) {
      box.style.opacity = '0.5'; // an action of the dead kernel: shown, greyed out
    }
    box.append(...Array.from(button.childNodes));
    button.replaceWith(box);
  });
  copy.querySelectorAll('input, select, textarea').forEach(el => {
    el.setAttribute('disabled', '');
  });
  copy.classList.add('mk-dash-frozen');
  return copy.outerHTML;
}

/** The monarch dashboard outputs of `panel` that still hold a widget view. */
function dashOutputs(panel: INotebookPanelLike): IDashOutput[] {
  const found: IDashOutput[] = [];
  for (const cell of panel.content.widgets) {
    const outputs = cell.model.outputs;
    if (!outputs) {
      continue;
    }
    for (let index = 0; index < outputs.length; index++) {
      const data = outputs.get(index).data;
      const view = data[WIDGET_MIME] as { model_id?: string } | undefined;
      const html = data['text/html'];
      const fallback = typeof html === 'string' ? html : Array.isArray(html) ? html.join('') : '';
      if (!view?.model_id || !fallback.includes('mk-dash-static')) {
        continue; // not a monarch dashboard (another widget), or already static
      }
      // the kernel's fallback names the mesh (monarch_kernel/widgets/snapshot.py);
      // parsed, never run (DOMParser runs no scripts)
      const doc = new DOMParser().parseFromString(fallback, 'text/html');
      const root = doc.querySelector<HTMLElement>('.mk-dash-static');
      const host = cell.outputArea?.widgets[index]?.node ?? null;
      const plain = data['text/plain'];
      found.push({
        outputs,
        index,
        modelId: view.model_id,
        fallback,
        text: typeof plain === 'string' ? plain : Array.isArray(plain) ? plain.join('') : '',
        mesh: root?.dataset.mesh ?? doc.querySelector('.mk-head b')?.textContent ?? 'NAME',
        detachable: root?.dataset.detachable === '1',
        host
      });
    }
  }
  return found;
}

/** The ids of the widget models `kernel` has (its `jupyter.widget` comms); null when it
 * cannot say (no kernel, or it did not answer). */
async function liveModels(kernel: Kernel.IKernelConnection | null): Promise<Set<string> | null> {
  if (!kernel || kernel.isDisposed || kernel.status === 'dead') {
    return new Set();
  }
  try {
    const reply = await kernel.requestCommInfo({ target_name: WIDGET_TARGET });
    const content = reply.content as { status: string; comms?: Record<string, unknown> };
    return content.status === 'ok' ? new Set(Object.keys(content.comms ?? {})) : null;
  } catch {
    return null;
  }
}

/** Freezes the orphaned dashboards of one notebook (see the top of this file). */
class NotebookGuard {
  /** model id -> the static copy of its view taken when the kernel was seen dying. */
  private captured = new Map<string, string>();
  /** When the kernel was seen dying (null: not since the last check). */
  private died: Date | null = null;
  private queue: Promise<void> = Promise.resolve();

  constructor(private panel: INotebookPanelLike) {
    const ctx = panel.sessionContext;
    ctx.statusChanged.connect((_s, status) => this.onStatus(status));
    ctx.kernelChanged.connect(() => {
      this.onDeath();
      void ctx.ready.then(() => this.check());
    });
    // a notebook opened (or the page reloaded) after its kernel died
    void Promise.all([panel.context?.ready, ctx.ready]).then(() => this.check());
  }

  private onStatus(status: Kernel.Status): void {
    if (status === 'restarting' || status === 'autorestarting') {
      this.onDeath();
    } else if (status === 'dead') {
      this.onDeath();
      this.check(); // no kernel comes back: freeze now
    } else if (status === 'idle' && this.died) {
      this.check(); // a kernel is back: what it does not know is orphaned
    }
  }

  /** Capture every live dashboard view now, while the DOM still shows it. */
  private onDeath(): void {
    this.died ??= new Date();
    for (const out of dashOutputs(this.panel)) {
      const html = out.host ? captureView(out.host) : null;
      if (html && !this.captured.has(out.modelId)) {
        this.captured.set(out.modelId, html);
      }
    }
  }

  /** Freeze each dashboard output whose widget model the current kernel does not have
   * (one check at a time). */
  check(): void {
    this.queue = this.queue.then(() => this.freezeOrphans()).catch(err => {
      console.error('monarch: freezing dashboards failed', err);
    });
  }

  private async freezeOrphans(): Promise<void> {
    if (this.panel.sessionContext.isDisposed || !dashOutputs(this.panel).length) {
      this.captured.clear();
      this.died = null;
      return;
    }
    const live = await liveModels(this.panel.sessionContext.session?.kernel ?? null);
    if (!live) {
      return; // the kernel did not answer: the next sign tries again
    }
    const died = this.died;
    // read the outputs again: the kernel's own retiring may have landed meanwhile
    for (const out of dashOutputs(this.panel)) {
      if (live.has(out.modelId)) {
        continue;
      }
      let snap = this.captured.get(out.modelId) ?? (out.host ? captureView(out.host) : null);
      if (snap && snap.length > MAX_SNAPSHOT_CHARS && out.host) {
        snap = captureView(out.host, false);
      }
      if (!snap || snap.length > MAX_SNAPSHOT_CHARS) {
        snap = out.fallback;
      }
      const why = whyFrozen(out.mesh, out.detachable, died);
      const line = document.createElement('div');
      line.className = 'mk-dash-retired mk-dash-orphaned';
      line.style.cssText = 'font-family:sans-serif;font-size:13px;padding:4px 0;color:inherit';
      const b = document.createElement('b');
      b.textContent = why;
      line.appendChild(b);
      out.outputs.set(out.index, {
        output_type: 'display_data',
        data: { 'text/html': line.outerHTML + snap, 'text/plain': `${why}\n${out.text}` },
        metadata: { monarch_kernel: { frozen: true, mesh: out.mesh } }
      });
    }
    this.captured.clear();
    this.died = null;
  }
}

/** Guard every notebook panel `widgets()` yields, once each (call again whenever the
 * shell's layout changes). */
export class FrozenDashboards {
  private guarded = new WeakSet<object>();

  scan(widgets: Iterable<Widget>): void {
    for (const widget of widgets) {
      const panel = widget as unknown as Partial<INotebookPanelLike>;
      if (!panel.sessionContext || !panel.content?.widgets || this.guarded.has(widget)) {
        continue;
      }
      this.guarded.add(widget);
      new NotebookGuard(panel as INotebookPanelLike);
    }
  }
}
