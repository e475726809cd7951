/**
 * jupyter-evalsched: the JupyterLab side panel of the per-host evaluation scheduler.
 */
import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import {
  ICommandPalette,
  MainAreaWidget,
  WidgetTracker
} from '@jupyterlab/apputils';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { ITranslator, nullTranslator } from '@jupyterlab/translation';

import { compareKey, EvalSchedAPI, ICompareTarget } from './api';
import type { CompareView } from './compare';
import { createRunDetailTab, RunDetailWidget } from './detail';
import { evalschedIcon } from './icon';
import { DEFAULT_OPTIONS, EvalSchedModel, IModelOptions } from './model';
// Activation needs it at once: the notifier must watch the model from the start.
// eslint-disable-next-line jupyter/prefer-lazy-imports
import { notificationMode, NotificationMode, RunNotifier } from './notify';
import { EvalSchedPanel, PANEL_ID } from './panel';

export { EvalSchedAPI } from './api';
export { EvalSchedModel } from './model';
export { EvalSchedPanel, PANEL_ID } from './panel';

const PLUGIN_ID = 'jupyter-evalsched:plugin';

namespace CommandIDs {
  export const open = 'jupyter-evalsched:open';
  export const refresh = 'jupyter-evalsched:refresh';
  export const openRun = 'jupyter-evalsched:open-run';
  export const compare = 'jupyter-evalsched:compare';
}

interface IPanelSettings extends IModelOptions {
  logTail: number;
  area: 'left' | 'right';
  rank: number;
  notifications: NotificationMode;
}

const DEFAULT_SETTINGS: IPanelSettings = {
  ...DEFAULT_OPTIONS,
  logTail: 200,
  area: 'right',
  rank: 900,
  notifications: 'failures'
};

/** The target of a comparison from command arguments (`sweep`, or `runs` as a list or "a,b"). */
function compareTarget(args: {
  [key: string]: unknown;
}): ICompareTarget | null {
  const baseline =
    typeof args.baseline === 'string' && args.baseline
      ? args.baseline
      : undefined;
  if (typeof args.sweep === 'string' && args.sweep) {
    return { sweep: args.sweep, baseline };
  }
  const raw = args.runs;
  const runs = (
    Array.isArray(raw)
      ? raw.map(String)
      : typeof raw === 'string'
        ? raw.split(',')
        : []
  )
    .map(r => r.trim())
    .filter(Boolean);
  return runs.length ? { runs, baseline } : null;
}

function readSettings(
  settings: ISettingRegistry.ISettings | null
): IPanelSettings {
  if (!settings) {
    return { ...DEFAULT_SETTINGS };
  }
  const get = <T>(key: keyof IPanelSettings): T =>
    (settings.get(key).composite ?? DEFAULT_SETTINGS[key]) as T;
  return {
    refreshInterval: get<number>('refreshInterval'),
    maxRefreshInterval: get<number>('maxRefreshInterval'),
    useWebSocket: get<boolean>('useWebSocket'),
    finishedLimit: get<number>('finishedLimit'),
    queueLimit: get<number>('queueLimit'),
    logTail: get<number>('logTail'),
    area: get<string>('area') === 'left' ? 'left' : 'right',
    rank: get<number>('rank'),
    notifications: notificationMode(get<string>('notifications'))
  };
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description:
    'A side panel for jupyter_evalsched: the VRAM ledger, the queue, running and finished runs.',
  autoStart: true,
  optional: [ILayoutRestorer, ICommandPalette, ISettingRegistry, ITranslator],
  activate: async (
    app: JupyterFrontEnd,
    restorer: ILayoutRestorer | null,
    palette: ICommandPalette | null,
    settingRegistry: ISettingRegistry | null,
    translator: ITranslator | null
  ): Promise<void> => {
    const trans = (translator ?? nullTranslator).load('jupyter_evalsched');

    let settings: ISettingRegistry.ISettings | null = null;
    if (settingRegistry) {
      try {
        settings = await settingRegistry.load(PLUGIN_ID);
      } catch (reason) {
        console.warn(
          `jupyter-evalsched: cannot load the settings of ${PLUGIN_ID}`,
          reason
        );
      }
    }
    let current = readSettings(settings);

    const api = new EvalSchedAPI(app.serviceManager.serverSettings);
    const model = new EvalSchedModel(api, current);

    const tracker = new WidgetTracker<MainAreaWidget<RunDetailWidget>>({
      namespace: 'jupyter-evalsched-run'
    });
    const openInTab = (id: string): void => {
      const existing = tracker.find(w => w.content.runId === id);
      if (existing) {
        app.shell.activateById(existing.id);
        return;
      }
      const widget = createRunDetailTab({
        model,
        id,
        trans,
        logTail: current.logTail
      });
      void tracker.add(widget);
      app.shell.add(widget, 'main');
      app.shell.activateById(widget.id);
    };

    const compareTracker = new WidgetTracker<MainAreaWidget<CompareView>>({
      namespace: 'jupyter-evalsched-compare'
    });
    const openCompare = async (target: ICompareTarget): Promise<void> => {
      const key = compareKey(target);
      const existing = compareTracker.find(
        w => compareKey(w.content.target) === key
      );
      if (existing) {
        app.shell.activateById(existing.id);
        if (target.baseline && existing.content.baseline !== target.baseline) {
          void existing.content.setBaseline(target.baseline);
        } else {
          void existing.content.load();
        }
        return;
      }
      // Loaded when first needed: most sessions never compare.
      const { createCompareTab } = await import('./compare');
      const opened = compareTracker.find(
        w => compareKey(w.content.target) === key
      );
      if (opened) {
        app.shell.activateById(opened.id); // opened meanwhile
        return;
      }
      const widget = createCompareTab({
        model,
        trans,
        target,
        openRun: openInTab
      });
      void compareTracker.add(widget);
      app.shell.add(widget, 'main');
      app.shell.activateById(widget.id);
    };

    const panel = new EvalSchedPanel({
      model,
      trans,
      logTail: current.logTail,
      openInTab,
      openCompare: target => void openCompare(target)
    });
    panel.node.dataset.notifications = current.notifications;
    panel.title.caption = trans.__('Evaluation scheduler');
    app.shell.add(panel, current.area, { rank: current.rank });
    if (restorer) {
      restorer.add(panel, 'jupyter-evalsched');
      void restorer.restore(tracker, {
        command: CommandIDs.openRun,
        args: widget => ({ id: widget.content.runId }),
        name: widget => widget.content.runId
      });
      void restorer.restore(compareTracker, {
        command: CommandIDs.compare,
        args: widget =>
          widget.content.target.sweep
            ? { sweep: widget.content.target.sweep }
            : { runs: (widget.content.target.runs ?? []).join(',') },
        name: widget => compareKey(widget.content.target)
      });
    }

    // Notifications when runs and sweeps this page watched end. "Open" of a sweep shows its row
    // in the panel, expanded; its comparison when the panel no longer lists it.
    const notifier = new RunNotifier({
      model,
      trans,
      mode: current.notifications,
      openRun: id => {
        model.start();
        openInTab(id);
      },
      revealSweep: id => {
        app.shell.activateById(PANEL_ID);
        if (!panel.revealSweep(id)) {
          void openCompare({ sweep: id });
        }
      },
      openCompare: target => void openCompare(target),
      note: entry => panel.noteNotification(entry)
    });
    panel.disposed.connect(() => notifier.dispose());

    // The panel starts the model when it is first shown (or a command needs data): a host
    // where nobody opens the panel pays nothing.
    if (panel.isVisible) {
      model.start();
    }

    settings?.changed.connect(() => {
      current = readSettings(settings);
      model.configure(current);
      panel.logTail = current.logTail;
      notifier.mode = current.notifications;
      panel.node.dataset.notifications = current.notifications;
    });

    app.commands.addCommand(CommandIDs.open, {
      label: trans.__('Open the Eval Scheduler Panel'),
      caption: trans.__(
        'Show the VRAM ledger, the queue and the runs of this host'
      ),
      icon: evalschedIcon,
      describedBy: { args: { type: 'object', properties: {} } },
      execute: () => {
        app.shell.activateById(PANEL_ID);
        model.start();
      }
    });
    app.commands.addCommand(CommandIDs.refresh, {
      label: trans.__('Refresh the Eval Scheduler Panel'),
      describedBy: { args: { type: 'object', properties: {} } },
      execute: async () => {
        model.start();
        await model.refresh();
      }
    });
    app.commands.addCommand(CommandIDs.openRun, {
      label: args =>
        args.id
          ? trans.__('Open Evaluation Run %1', String(args.id))
          : trans.__('Open Evaluation Run'),
      icon: evalschedIcon,
      describedBy: {
        args: {
          type: 'object',
          properties: {
            id: {
              type: 'string',
              description: trans.__('The id of the run to open')
            }
          }
        }
      },
      execute: args => {
        const id = String(args.id ?? '');
        if (!id) {
          return;
        }
        model.start();
        openInTab(id);
      }
    });

    app.commands.addCommand(CommandIDs.compare, {
      label: trans.__('Compare Evaluation Runs'),
      icon: evalschedIcon,
      describedBy: {
        args: {
          type: 'object',
          properties: {
            sweep: {
              type: 'string',
              description: trans.__('Compare the runs of this sweep')
            },
            runs: {
              type: 'string',
              description: trans.__(
                'Compare these runs (comma-separated ids; the first is the baseline)'
              )
            },
            baseline: {
              type: 'string',
              description: trans.__('The run the others are compared against')
            }
          }
        }
      },
      isEnabled: args => compareTarget(args) !== null,
      execute: args => {
        const target = compareTarget(args);
        if (!target) {
          return;
        }
        model.start();
        return openCompare(target);
      }
    });

    if (palette) {
      const category = trans.__('Eval Scheduler');
      palette.addItem({ command: CommandIDs.open, category });
      palette.addItem({ command: CommandIDs.refresh, category });
    }
  }
};

export default plugin;
