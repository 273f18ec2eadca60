"""The dashboard's colours: one per tile state, and the live dashboard's style sheet.

The live widgets take their colours from JupyterLab's theme variables (:data:`CSS`); the
static snapshot, which may be shown outside JupyterLab, uses fixed ones (:data:`COLORS`).
"""

from __future__ import annotations

#: state -> (background, border)
COLORS = {
    "starting": ("#e5e7eb", "#9ca3af"),
    "idle": ("#dcfce7", "#16a34a"),
    "busy": ("#dbeafe", "#2563eb"),
    "paused": ("#fef9c3", "#ca8a04"),  # a debugger holds the rank
    "error": ("#ffedd5", "#ea580c"),
    "dead": ("#fee2e2", "#dc2626"),
    "stopped": ("#f3f4f6", "#9ca3af"),
}
#: Every tile state, in the order the header counts them.
STATES = ("starting", "idle", "busy", "paused", "error", "dead", "stopped")

#: state -> the JupyterLab CSS variable of its colour (light, dark and high-contrast
#: themes each define these), with a fallback for frontends without JupyterLab's theme.
STATE_VARS = {
    "starting": "var(--jp-border-color1, #9ca3af)",
    "idle": "var(--jp-success-color1, #16a34a)",
    "busy": "var(--jp-brand-color1, #2563eb)",
    # JupyterLab's themes have no yellow: a fixed one (it only tints, text stays legible)
    "paused": "#ca8a04",
    "error": "var(--jp-warn-color1, #ea580c)",
    "dead": "var(--jp-error-color1, #dc2626)",
    "stopped": "var(--jp-border-color1, #9ca3af)",
}

# Every colour of the live dashboard comes from JupyterLab's theme variables (--jp-*), so
# light, dark and high-contrast themes are all legible: text is the theme's font colour on
# the theme's layout colour, and a state only tints a tile's background (at most 16%) and
# colours its border. The fallbacks after each variable are for frontends without them.
CSS = (
    """
<style>
.mk-dash { font-family: var(--jp-ui-font-family, sans-serif); font-size: 12px;
  color: var(--jp-ui-font-color1, #111827); }
.mk-dash .mk-head { padding: 4px 2px; line-height: 1.6; }
.mk-dash .mk-hosts { padding: 2px; line-height: 1.5; }
.mk-dash .mk-host.mk-wait, .mk-dash .mk-notice { color: var(--jp-warn-color0, #92400e); }
.mk-dash .mk-host.mk-bad { color: var(--jp-error-color0, #b91c1c); }
.mk-dash .mk-cmd { user-select: all; background: var(--jp-layout-color2, #f3f4f6);
  color: var(--jp-content-font-color1, #111827); padding: 0 4px; word-break: break-all; }
.mk-dash .mk-chip { display: inline-block; border-radius: 8px; padding: 0 6px;
  margin-right: 4px; font-size: 11px; border: 1px solid var(--mk-c);
  background: color-mix(in srgb, var(--mk-c) 16%, var(--jp-layout-color1, #fff)); }
.mk-dash .mk-tile { white-space: pre !important; text-align: left !important;
  line-height: 1.35 !important; padding: 4px 6px !important; border-radius: 6px !important;
  border: 2px solid var(--mk-c) !important; overflow: hidden; text-overflow: clip;
  font-size: 11px; font-family: var(--jp-code-font-family, monospace);
  box-shadow: none !important; color: var(--jp-ui-font-color1, #111827) !important;
  background: var(--jp-layout-color2, #f3f4f6) !important;
  background: color-mix(in srgb, var(--mk-c) 16%, var(--jp-layout-color1, #fff)) !important; }
.mk-dash .mk-tile.mk-s-starting { border-style: dashed !important; }
.mk-dash .mk-tile.mk-s-stopped { opacity: 0.75; }
.mk-dash .mk-tile.mk-selected { outline: 2px solid var(--jp-ui-font-color1, #111827);
  outline-offset: -5px; }
.mk-dash .mk-detail pre, .mk-dash .mk-errors pre { background: var(--jp-layout-color2, #f9fafb);
  color: var(--jp-content-font-color1, #111827); border: 1px solid var(--jp-border-color2, #e5e7eb);
  padding: 4px 6px; margin: 2px 0 6px; max-height: 180px; overflow: auto; font-size: 11px;
  white-space: pre-wrap; overflow-wrap: anywhere; }
.mk-dash .mk-detail { overflow-wrap: anywhere; }
.mk-dash summary { cursor: pointer; }
.mk-dash .mk-sec { font-weight: bold; margin: 6px 0 2px; }
.mk-dash .mk-incident { border-left: 3px solid var(--jp-warn-color1, #ea580c);
  padding-left: 6px; margin: 4px 0; }
.mk-dash .mk-root { background: var(--jp-error-color1, #dc2626); color: #fff;
  border-radius: 4px; padding: 0 4px; margin-right: 4px; font-size: 10px; }
.mk-dash .mk-root.mk-interrupt { background: var(--jp-layout-color3, #6b7280);
  color: var(--jp-ui-font-color0, #fff); }
.mk-dash .mk-charts svg { margin: 2px 6px 2px 0; }
.mk-dash .mk-muted { color: var(--jp-ui-font-color2, #6b7280); }
.mk-dash .mk-phase { border-radius: 8px; padding: 0 6px; font-weight: bold;
  border: 1px solid var(--mk-c);
  background: color-mix(in srgb, var(--mk-c) 16%, var(--jp-layout-color1, #fff)); }
.mk-dash .mk-phase-recovering { --mk-c: var(--jp-warn-color1, #d97706); }
.mk-dash .mk-phase-stopping { --mk-c: var(--jp-border-color1, #9ca3af); }
.mk-dash .mk-recovery { border-left: 3px solid var(--jp-brand-color1, #2563eb);
  padding-left: 6px; margin: 4px 0; }
.mk-dash .mk-jobs { margin: 2px 0; }
.mk-dash .mk-job { font-family: var(--jp-code-font-family, monospace); font-size: 11px;
  line-height: 28px; margin-right: 6px; }
"""
    + "".join(f".mk-dash .mk-s-{s} {{ --mk-c: {v}; }}\n" for s, v in STATE_VARS.items())
    + "</style>\n"
)
