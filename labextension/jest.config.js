// Unit tests of the extension's pure modules (no DOM, no JupyterLab): ts-jest, as the JupyterLab
// extension template runs them; `jlpm test`.
module.exports = {
  testEnvironment: 'node',
  testRegex: 'src/__tests__/.*\\.spec\\.ts$',
  transform: {
    '^.+\\.ts$': ['ts-jest', { tsconfig: 'tsconfig.test.json' }]
  }
};
