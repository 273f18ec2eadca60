// JupyterLab side of monarch_kernel: a Meshes sidebar, a status bar item and palette
// commands. The kernel pushes every mesh's state over the comm target
// "monarch_kernel.meshes" (see monarch_kernel/kernel/lab.py): this extension opens one
// comm per monarch kernel that an open notebook or console uses, on that notebook's own
// connection, and listens; it never polls the kernel, needs no extra port and no server
// extension.

import {
  ILabShell,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { Kernel } from '@jupyterlab/services';
import { IStatusBar } from '@jupyterlab/statusbar';
import { Widget } from '@lumino/widgets';

import { FrozenDashboards } from './frozen';

const TARGET = 'monarch_kernel.meshes';
const KERNEL_NAME = 'monarch';
const SIDEBAR_ID = 'monarch-meshes';

/** One rank as the kernel describes it. */
interface IRank {
  rank: number;
  state: string;
}

/** One host's ranks: listed (small meshes), or, for a big mesh, its first rank and
 * one state code a rank (`legend` in the state maps codes to states). */
interface IHost {
  index: number;
  name: string;
  ranks?: IRank[];
  first?: number;
  states?: string;
}

/** One mesh as the kernel describes it. */
interface IMesh {
  name: string;
  shape: string;
  backend: string;
  phase: string;
  world: number;
  alive: number;
  dead: number;
  rate: number;
  hosts: IHost[];
}

/** What a kernel pushes. */
interface IState {
  meshes: IMesh[];
  notice: string;
  legend?: Record<string, string>;
}

/** A host's ranks as `{rank, state}`, whichever form the kernel sent them in. */
export function hostRanks(host: IHost, legend: Record<string, string> = {}): IRank[] {
  if (host.ranks) {
    return host.ranks;
  }
  const first = host.first ?? 0;
  return [...(host.states ?? '')].map((code, i) => ({
    rank: first + i,
    state: legend[code] ?? 'starting'
  }));
}

/** `1.2 GB/s`-style text of bytes per second. */
export function rateText(bps: number): string {
  const units: [number, string][] = [
    [1e9, 'GB/s'],
    [1e6, 'MB/s'],
    [1e3, 'KB/s']
  ];
  for (const [scale, unit] of units) {
    if (bps >= scale) {
      return `${(bps / scale).toFixed(1)} ${unit}`;
    }
  }
  return `${Math.round(bps)} B/s`;
}

/** What the model needs of a notebook's (or console's) session context. */
interface ISessionLike {
  session: { kernel: Kernel.IKernelConnection | null } | null;
  kernelChanged: { connect: (fn: () => void) => void };
  ready: Promise<void>;
}

/** The comms to every monarch kernel that an open notebook or console talks to, and
 * the meshes each reported.
 *
 * The comm is opened on the notebook's own kernel connection: that connection already
 * handles the kernel's comms (the widgets'). A second connection of our own would see
 * every widget comm the kernel opens, know no target for it, and close it. */
class MeshModel {
  readonly changed = new Set<() => void>();
  private comms = new Map<string, Kernel.IComm>();
  private states = new Map<string, IState>();
  private contexts = new Set<ISessionLike>();

  constructor(shell: ILabShell) {
    const scan = () => {
      for (const widget of shell.widgets('main')) {
        const ctx = (widget as unknown as { sessionContext?: ISessionLike }).sessionContext;
        if (ctx && !this.contexts.has(ctx)) {
          this.watch(ctx, widget);
        }
      }
    };
    shell.layoutModified.connect(scan);
    scan();
  }

  /** Every mesh of every monarch kernel, with the kernel it lives in (and the code ->
   * state legend of its kernel). */
  meshes(): { kernel: string; mesh: IMesh; legend: Record<string, string> }[] {
    const out: { kernel: string; mesh: IMesh; legend: Record<string, string> }[] = [];
    for (const [kernel, state] of this.states) {
      for (const mesh of state.meshes) {
        out.push({ kernel, mesh, legend: state.legend ?? {} });
      }
    }
    return out;
  }

  /** Whether any monarch kernel is connected (else the status item hides). */
  connected(): boolean {
    return this.comms.size > 0;
  }

  notices(): string[] {
    return [...this.states.values()].map(s => s.notice).filter(n => n);
  }

  /** Ask the kernel `kernel` to act on mesh `mesh`. */
  act(kernel: string, mesh: string, action: string): void {
    const comm = this.comms.get(kernel);
    if (comm && !comm.isDisposed) {
      comm.send({ action, mesh });
    }
  }

  private emit(): void {
    for (const fn of this.changed) {
      fn();
    }
  }

  private watch(ctx: ISessionLike, widget: Widget): void {
    this.contexts.add(ctx);
    const attach = () => this.attach(ctx.session?.kernel ?? null);
    ctx.kernelChanged.connect(attach);
    void ctx.ready.then(attach);
    widget.disposed.connect(() => {
      this.contexts.delete(ctx);
      const id = ctx.session?.kernel?.id;
      if (id) {
        // its connection goes with it: another widget on that kernel takes over
        this.comms.delete(id);
        this.states.delete(id);
        for (const other of this.contexts) {
          this.attach(other.session?.kernel ?? null);
        }
        this.emit();
      }
    });
  }

  /** Open our comm on `kernel` (once per kernel), and again after a restart. */
  private attach(kernel: Kernel.IKernelConnection | null): void {
    if (!kernel || kernel.name !== KERNEL_NAME || this.comms.has(kernel.id)) {
      return;
    }
    const id = kernel.id;
    const open = () => {
      const comm = kernel.createComm(TARGET);
      comm.onMsg = msg => {
        this.states.set(id, msg.content.data as unknown as IState);
        this.emit();
      };
      comm.onClose = () => {
        this.states.delete(id);
        this.emit();
      };
      this.comms.set(id, comm);
      comm.open({});
      this.emit();
    };
    // a restarted kernel forgets its comms: open a new one once it is back
    let restarting = false;
    kernel.statusChanged.connect((_k, status) => {
      if (status === 'restarting' || status === 'autorestarting') {
        restarting = true;
        this.states.delete(id);
        this.emit();
      } else if (restarting && status === 'idle') {
        restarting = false;
        open();
      }
    });
    open();
  }
}

/** The Meshes sidebar: each mesh's shape, backend, a host x rank grid in state colours,
 * its transfer rate and actions. */
class MeshSidebar extends Widget {
  /** A line of our own under the meshes (e.g. why a button did nothing). */
  hint = '';

  constructor(
    private model: MeshModel,
    private newDashboardCell: (kernel: string, mesh: string) => Promise<boolean>
  ) {
    super();
    this.id = SIDEBAR_ID;
    this.addClass('mk-lab-sidebar');
    this.title.caption = 'Monarch meshes';
    this.title.label = '⬢ Meshes';
    model.changed.add(() => this.render());
    this.render();
  }

  render(): void {
    const node = this.node;
    node.replaceChildren();
    const head = document.createElement('h3');
    head.textContent = 'Meshes';
    node.appendChild(head);
    const meshes = this.model.meshes();
    if (!meshes.length) {
      const empty = document.createElement('p');
      empty.className = 'mk-lab-empty';
      empty.textContent =
        'No live meshes. Create one in a notebook with the Monarch kernel: %mesh trainers --gpus 4';
      node.appendChild(empty);
    }
    for (const { kernel, mesh, legend } of meshes) {
      node.appendChild(this.meshNode(kernel, mesh, legend));
    }
    for (const notice of [...this.model.notices(), this.hint].filter(n => n)) {
      const p = document.createElement('p');
      p.className = 'mk-lab-notice';
      p.textContent = notice;
      node.appendChild(p);
    }
  }

  private meshNode(kernel: string, mesh: IMesh, legend: Record<string, string>): HTMLElement {
    const box = document.createElement('section');
    box.className = 'mk-lab-mesh';
    box.dataset.mesh = mesh.name;
    box.dataset.dead = String(mesh.dead);
    const title = document.createElement('div');
    title.className = 'mk-lab-title';
    const name = document.createElement('b');
    name.textContent = mesh.name;
    const facts = document.createElement('span');
    facts.textContent =
      ` ${mesh.shape} · ${mesh.backend} · ${mesh.phase} · ` +
      `${mesh.alive}/${mesh.world} alive · ${rateText(mesh.rate)}`;
    title.append(name, facts);
    box.appendChild(title);
    const grid = document.createElement('div');
    // a big mesh (its hosts' states sent as codes): small cells without numbers, a
    // heat map whose hover names the rank
    const heat = mesh.hosts.some(h => h.states !== undefined);
    grid.className = heat ? 'mk-lab-grid mk-lab-heat' : 'mk-lab-grid';
    for (const host of mesh.hosts) {
      const row = document.createElement('div');
      row.className = 'mk-lab-host';
      const label = document.createElement('span');
      label.className = 'mk-lab-hostname';
      label.textContent = host.name;
      label.title = host.name;
      row.appendChild(label);
      for (const r of hostRanks(host, legend)) {
        const cell = document.createElement('span');
        cell.className = `mk-lab-rank mk-lab-s-${r.state}`;
        cell.dataset.state = r.state;
        cell.dataset.rank = String(r.rank);
        cell.title = `rank ${r.rank}: ${r.state} · ${host.name}`;
        if (!heat) {
          cell.textContent = String(r.rank);
        }
        row.appendChild(cell);
      }
      grid.appendChild(row);
    }
    box.appendChild(grid);
    const actions = document.createElement('div');
    actions.className = 'mk-lab-actions';
    const button = (label: string, tip: string, fn: () => void, disabled = false) => {
      const b = document.createElement('button');
      b.className = 'jp-Button jp-mod-styled jp-mod-reject mk-lab-button';
      b.textContent = label;
      b.title = tip;
      b.disabled = disabled;
      b.addEventListener('click', fn);
      actions.appendChild(b);
    };
    button('Interrupt', 'KeyboardInterrupt in the code every rank runs', () =>
      this.model.act(kernel, mesh.name, 'interrupt')
    );
    button(
      'Restart dead',
      'Restart the dead ranks',
      () => this.model.act(kernel, mesh.name, 'restart'),
      mesh.dead === 0
    );
    button('Stop', 'Stop every rank of this mesh', () =>
      this.model.act(kernel, mesh.name, 'stop')
    );
    button('Dashboard', 'Show this mesh’s dashboard in a new cell below the active one', () => {
      void this.newDashboardCell(kernel, mesh.name).then(added => {
        if (!added && !showDashboard(mesh.name)) {
          this.hint = `Open the notebook that uses ${mesh.name}, then click again (or run ${mesh.name}.dashboard() in a cell).`;
          this.render();
        }
      });
    });
    box.appendChild(actions);
    return box;
  }
}

/** What is used of a notebook panel (the notebook package is not a dependency). */
interface INotebookLike {
  content?: {
    activeCell?: { model: { sharedModel: { setSource(source: string): void } } } | null;
  };
  sessionContext?: { session?: { kernel?: { id: string } | null } | null };
}

/** In the current notebook, if its kernel is ``kernel``: a new cell below the active one
 * that shows ``mesh``'s dashboard (``mesh.dashboard()``), run at once. False when the
 * current main-area widget is not that kernel's notebook. Uses the notebook extension's
 * own commands, so no notebook package is needed here. */
async function dashboardInNewCell(
  app: JupyterFrontEnd,
  kernel: string,
  mesh: string
): Promise<boolean> {
  const panel = app.shell.currentWidget as unknown as INotebookLike | null;
  if (!panel?.content || panel?.sessionContext?.session?.kernel?.id !== kernel) {
    return false;
  }
  await app.commands.execute('notebook:insert-cell-below');
  const cell = panel.content.activeCell;
  if (!cell) {
    return false;
  }
  cell.model.sharedModel.setSource(`${mesh}.dashboard()`);
  await app.commands.execute('notebook:run-cell');
  return true;
}

/** Scroll the mesh's live dashboard (in an open notebook) into view; false if none is
 * (a frozen snapshot of a dead kernel's dashboard does not count). */
function showDashboard(name: string): boolean {
  for (const head of document.querySelectorAll('.mk-dash:not(.mk-dash-frozen) .mk-head b')) {
    if (head.textContent === name) {
      head.scrollIntoView({ behavior: 'smooth', block: 'start' });
      return true;
    }
  }
  return false;
}

/** `⬢ trainers 4/4 · 1.2 GB/s`, red when a rank is dead; a click opens the sidebar. */
class MeshStatus extends Widget {
  constructor(
    private model: MeshModel,
    open: () => void
  ) {
    super();
    this.addClass('mk-lab-status');
    this.node.title = 'Monarch meshes: click to open the sidebar';
    this.node.addEventListener('click', open);
    model.changed.add(() => this.render());
    this.render();
  }

  render(): void {
    // only where a monarch kernel is in use: other notebooks get no status item
    this.setHidden(!this.model.connected());
    const meshes = this.model.meshes();
    const dead = meshes.some(m => m.mesh.dead > 0);
    this.toggleClass('mk-lab-bad', dead);
    this.node.textContent = meshes.length
      ? meshes
          .map(
            ({ mesh }) =>
              `⬢ ${mesh.name} ${mesh.alive}/${mesh.world} · ${rateText(mesh.rate)}`
          )
          .join('   ')
      : '⬢ no meshes';
  }
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'monarch-kernel-labextension:plugin',
  description: 'Meshes sidebar and status bar item for the monarch kernel',
  autoStart: true,
  requires: [ILabShell],
  optional: [IStatusBar, ICommandPalette],
  activate: (
    app: JupyterFrontEnd,
    shell: ILabShell,
    statusBar: IStatusBar | null,
    palette: ICommandPalette | null
  ) => {
    const model = new MeshModel(shell);
    // dashboards of a kernel that died without retiring them: static snapshots
    const frozen = new FrozenDashboards();
    const scan = () => frozen.scan(shell.widgets('main'));
    shell.layoutModified.connect(scan);
    scan();
    const sidebar = new MeshSidebar(model, (kernel, mesh) =>
      dashboardInNewCell(app, kernel, mesh)
    );
    shell.add(sidebar, 'left', { rank: 900 });
    const open = () => shell.activateById(SIDEBAR_ID);
    if (statusBar) {
      statusBar.registerStatusItem('monarch-kernel-labextension:status', {
        item: new MeshStatus(model, open),
        align: 'left',
        rank: 5
      });
    }
    const forAll = (action: string) => () => {
      for (const { kernel, mesh } of model.meshes()) {
        model.act(kernel, mesh.name, action);
      }
    };
    const commands: [string, string, () => void][] = [
      ['monarch:open-meshes', 'Monarch: Show Meshes', open],
      ['monarch:interrupt-meshes', 'Monarch: Interrupt All Meshes', forAll('interrupt')],
      ['monarch:restart-dead', 'Monarch: Restart Dead Ranks', forAll('restart')],
      ['monarch:stop-meshes', 'Monarch: Stop All Meshes', forAll('stop')]
    ];
    for (const [id, label, execute] of commands) {
      app.commands.addCommand(id, { label, execute });
      palette?.addItem({ command: id, category: 'Monarch' });
    }
  }
};

export default plugin;
