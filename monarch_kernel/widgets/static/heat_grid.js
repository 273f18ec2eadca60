// The heat-map grid of a big mesh (an anywidget front end): one small cell per rank,
// coloured by its state; hover shows that rank's details, a click selects it.
//
// The kernel sends `states`, one character per rank (`legend` maps a character to a
// state name), only when a state changed. A rank's details (host, pid, what it runs,
// its last line or error) are asked for when the pointer comes over its cell ("hover")
// and come back as a "detail" message: nothing per rank is sent that no one looks at.

const HOVER_MS = 60; // a pointer sweeping over the grid asks only where it stops

function render({ model, el }) {
  const root = document.createElement("div");
  root.className = "mk-heat";
  const grid = document.createElement("div");
  grid.className = "mk-heat-grid";
  grid.setAttribute("role", "grid");
  // The hover box lives in the page's body, fixed to the viewport: inside the output
  // area it was clipped by the widget's box or painted over by the widgets below it.
  const tip = document.createElement("div");
  tip.className = "mk-heat-tip";
  tip.hidden = true;
  document.body.appendChild(tip);
  root.append(grid);
  el.appendChild(root);

  const cells = [];
  const details = new Map(); // rank -> detail text (the last one the kernel sent)
  let hovered = -1;
  let asked = -1;
  let timer = null;

  const stateOf = (r) => model.get("legend")[model.get("states")[r]] || "starting";

  function showTip() {
    if (hovered < 0 || hovered >= cells.length) {
      tip.hidden = true;
      return;
    }
    const detail = details.get(hovered);
    tip.textContent = `rank ${hovered} · ${stateOf(hovered)}\n` + (detail ?? "…");
    const box = cells[hovered].getBoundingClientRect();
    tip.hidden = false;
    const left = Math.min(box.right + 6, window.innerWidth - tip.offsetWidth - 4);
    tip.style.left = `${Math.max(0, left)}px`;
    tip.style.top = `${box.bottom + 4}px`;
  }

  function draw() {
    const states = model.get("states");
    grid.style.gridTemplateColumns = `repeat(${model.get("columns")}, var(--mk-cell, 12px))`;
    while (cells.length < states.length) {
      const cell = document.createElement("div");
      cell.dataset.rank = String(cells.length);
      cell.setAttribute("role", "gridcell");
      grid.appendChild(cell);
      cells.push(cell);
    }
    while (cells.length > states.length) cells.pop().remove();
    const selected = model.get("selected");
    for (let r = 0; r < cells.length; r++) {
      const state = stateOf(r);
      const cls = `mk-cell mk-s-${state}` + (r === selected ? " mk-selected" : "");
      if (cells[r].className !== cls) {
        cells[r].className = cls;
        cells[r].dataset.state = state;
        cells[r].setAttribute("aria-label", `rank ${r}: ${state}`);
      }
    }
    if (hovered >= 0) {
      // the state changed: its details are stale, ask again
      details.delete(hovered);
      asked = -1;
      ask();
      showTip();
    }
  }

  function ask() {
    clearTimeout(timer);
    timer = setTimeout(() => {
      if (hovered >= 0 && hovered !== asked) {
        asked = hovered;
        model.send({ type: "hover", rank: hovered });
      }
    }, HOVER_MS);
  }

  const cellRank = (ev) => {
    const cell = ev.target.closest ? ev.target.closest(".mk-cell") : null;
    return cell ? Number(cell.dataset.rank) : -1;
  };
  grid.addEventListener("mouseover", (ev) => {
    const r = cellRank(ev);
    if (r < 0 || r === hovered) return;
    hovered = r;
    showTip();
    ask();
  });
  grid.addEventListener("mouseleave", () => {
    hovered = -1;
    asked = -1;
    clearTimeout(timer);
    showTip();
  });
  grid.addEventListener("click", (ev) => {
    const r = cellRank(ev);
    if (r >= 0) model.send({ type: "select", rank: r });
  });

  const onMsg = (msg) => {
    if (msg && msg.type === "detail") {
      details.set(msg.rank, msg.text);
      if (msg.rank === hovered) showTip();
    }
  };
  model.on("change:states", draw);
  model.on("change:selected", draw);
  model.on("change:columns", draw);
  model.on("msg:custom", onMsg);
  draw();
  return () => {
    clearTimeout(timer);
    tip.remove();
    model.off("change:states", draw);
    model.off("change:selected", draw);
    model.off("change:columns", draw);
    model.off("msg:custom", onMsg);
  };
}

export default { render };
