// JupyterLab side of monarch_kernel: a Meshes sidebar, a status bar item and palette
// commands. The kernel pushes every mesh's state over the comm target
// "monarch_kernel.meshes" (see monarch_kernel/kernel/lab.py): this extension opens one
// comm per running monarch kernel and only listens; it never polls the kernel, needs no
// extra port and no server extension.

import {
  ILabShell,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { Kernel } from '@jupyterlab/services';
import { IStatusBar } from '@jupyterlab/statusbar';
import { Widget } from '@lumino/widgets';

const TARGET = 'monarch_kernel.meshes';
const KERNEL_NAME = 'monarch';
const SIDEBAR_ID = 'monarch-meshes';

/** One rank as the kernel describes it. */
interface IRank {
  rank: number;
  state: string;
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
  hosts: { index: number; name: string; ranks: IRank[] }[];
}

/** What a kernel pushes. */
interface IState {
  meshes: IMesh[];
  notice: string;
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

/** The comms to every running monarch kernel and the meshes each reported. */
class MeshModel {
  readonly changed = new Set<() => void>();
  private comms = new Map<string, Kernel.IComm>();
  private states = new Map<string, IState>();

  constructor(private app: JupyterFrontEnd) {
    const kernels = app.serviceManager.kernels;
    kernels.runningChanged.connect(() => this.sync());
    void kernels.ready.then(() => this.sync());
  }

  /** Every mesh of every monarch kernel, with the kernel it lives in. */
  meshes(): { kernel: string; mesh: IMesh }[] {
    const out: { kernel: string; mesh: IMesh }[] = [];
    for (const [kernel, state] of this.states) {
      for (const mesh of state.meshes) {
        out.push({ kernel, mesh });
      }
    }
    return out;
  }

  notices(): string[] {
    return [...this.states.values()].map(s => s.notice).filter(n => n);
  }

  /** Ask the kernel `kernel` to act on mesh `mesh`. */
  act(kernel: string, mesh: string, action: string): void {
    this.comms.get(kernel)?.send({ action, mesh });
  }

  private emit(): void {
    for (const fn of this.changed) {
      fn();
    }
  }

  /** Open a comm to each new monarch kernel; forget kernels that went away. */
  private sync(): void {
    const running = [...this.app.serviceManager.kernels.running()].filter(
      m => m.name === KERNEL_NAME
    );
    const ids = new Set(running.map(m => m.id));
    for (const id of [...this.comms.keys()]) {
      if (!ids.has(id)) {
        this.comms.delete(id);
        this.states.delete(id);
      }
    }
    for (const model of running) {
      if (!this.comms.has(model.id)) {
        this.connect(model);
      }
    }
    this.emit();
  }

  private connect(model: Kernel.IModel): void {
    const kernel = this.app.serviceManager.kernels.connectTo({
      model,
      handleComms: true
    });
    const open = () => {
      const comm = kernel.createComm(TARGET);
      comm.onMsg = msg => {
        this.states.set(model.id, msg.content.data as unknown as IState);
        this.emit();
      };
      comm.onClose = () => {
        this.states.delete(model.id);
        this.emit();
      };
      this.comms.set(model.id, comm);
      comm.open({});
    };
    // a restarted kernel forgets its comms: open a new one once it is back
    let restarting = false;
    kernel.statusChanged.connect((_k, status) => {
      if (status === 'restarting' || status === 'autorestarting') {
        restarting = true;
        this.states.delete(model.id);
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
  constructor(private model: MeshModel) {
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
    for (const { kernel, mesh } of meshes) {
      node.appendChild(this.meshNode(kernel, mesh));
    }
    for (const notice of this.model.notices()) {
      const p = document.createElement('p');
      p.className = 'mk-lab-notice';
      p.textContent = notice;
      node.appendChild(p);
    }
  }

  private meshNode(kernel: string, mesh: IMesh): HTMLElement {
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
    grid.className = 'mk-lab-grid';
    for (const host of mesh.hosts) {
      const row = document.createElement('div');
      row.className = 'mk-lab-host';
      const label = document.createElement('span');
      label.className = 'mk-lab-hostname';
      label.textContent = host.name;
      row.appendChild(label);
      for (const r of host.ranks) {
        const cell = document.createElement('span');
        cell.className = `mk-lab-rank mk-lab-s-${r.state}`;
        cell.dataset.state = r.state;
        cell.title = `rank ${r.rank}: ${r.state}`;
        cell.textContent = String(r.rank);
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
    button('Dashboard', 'Scroll to this mesh’s dashboard', () => showDashboard(mesh.name));
    box.appendChild(actions);
    return box;
  }
}

/** Scroll the mesh's dashboard (in an open notebook) into view. */
function showDashboard(name: string): void {
  for (const head of document.querySelectorAll('.mk-dash .mk-head b')) {
    if (head.textContent === name) {
      head.scrollIntoView({ behavior: 'smooth', block: 'start' });
      return;
    }
  }
  window.alert(`No dashboard of ${name} is open; run ${name}.dashboard() in a cell.`);
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
    const model = new MeshModel(app);
    const sidebar = new MeshSidebar(model);
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
