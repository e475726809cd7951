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

import { EvalSchedAPI } from './api';
import { createRunDetailTab, RunDetailWidget } from './detail';
import { evalschedIcon } from './icon';
import { DEFAULT_OPTIONS, EvalSchedModel, IModelOptions } from './model';
import { EvalSchedPanel, PANEL_ID } from './panel';

export { EvalSchedAPI } from './api';
export { EvalSchedModel } from './model';
export { EvalSchedPanel, PANEL_ID } from './panel';

const PLUGIN_ID = 'jupyter-evalsched:plugin';

namespace CommandIDs {
  export const open = 'jupyter-evalsched:open';
  export const refresh = 'jupyter-evalsched:refresh';
  export const openRun = 'jupyter-evalsched:open-run';
}

interface IPanelSettings extends IModelOptions {
  logTail: number;
  area: 'left' | 'right';
  rank: number;
}

const DEFAULT_SETTINGS: IPanelSettings = {
  ...DEFAULT_OPTIONS,
  logTail: 200,
  area: 'right',
  rank: 900
};

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
    logTail: get<number>('logTail'),
    area: get<string>('area') === 'left' ? 'left' : 'right',
    rank: get<number>('rank')
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

    const panel = new EvalSchedPanel({
      model,
      trans,
      logTail: current.logTail,
      openInTab
    });
    panel.title.caption = trans.__('Evaluation scheduler');
    app.shell.add(panel, current.area, { rank: current.rank });
    if (restorer) {
      restorer.add(panel, 'jupyter-evalsched');
      void restorer.restore(tracker, {
        command: CommandIDs.openRun,
        args: widget => ({ id: widget.content.runId }),
        name: widget => widget.content.runId
      });
    }

    // The panel starts the model when it is first shown (or a command needs data): a host
    // where nobody opens the panel pays nothing.
    if (panel.isVisible) {
      model.start();
    }

    settings?.changed.connect(() => {
      current = readSettings(settings);
      model.configure(current);
      panel.logTail = current.logTail;
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

    if (palette) {
      const category = trans.__('Eval Scheduler');
      palette.addItem({ command: CommandIDs.open, category });
      palette.addItem({ command: CommandIDs.refresh, category });
    }
  }
};

export default plugin;
