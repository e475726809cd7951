import { LabIcon } from '@jupyterlab/ui-components';

/**
 * A GPU chip with a bar chart: the side-bar icon of the panel. Inline SVG, themed through
 * `jp-icon3` so that it follows light and dark themes.
 */
const svgstr = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
  <g class="jp-icon3" fill="#616161">
    <path d="M9 1h2v3H9zM13 1h2v3h-2zM9 20h2v3H9zM13 20h2v3h-2zM1 9h3v2H1zM1 13h3v2H1zM20 9h3v2h-3zM20 13h3v2h-3z"/>
    <path d="M6.5 4h11A2.5 2.5 0 0 1 20 6.5v11a2.5 2.5 0 0 1-2.5 2.5h-11A2.5 2.5 0 0 1 4 17.5v-11A2.5 2.5 0 0 1 6.5 4zm0 2a.5.5 0 0 0-.5.5v11a.5.5 0 0 0 .5.5h11a.5.5 0 0 0 .5-.5v-11a.5.5 0 0 0-.5-.5z"/>
    <path d="M8 13h2v3H8zM11 10h2v6h-2zM14 8h2v8h-2z"/>
  </g>
</svg>`;

export const evalschedIcon = new LabIcon({
  name: 'jupyter-evalsched:icon',
  svgstr
});
