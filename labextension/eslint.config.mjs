import js from '@eslint/js';
import { defineConfig } from 'eslint/config';
import tseslint from 'typescript-eslint';
import prettierRecommended from 'eslint-plugin-prettier/recommended';
import globals from 'globals';
import jupyterPlugin from '@jupyter/eslint-plugin';

// The JupyterLab extension template's ESLint settings (jupyterlab/extension-template,
// template/eslint.config.mjs.jinja), for a frontend-and-server extension with jest tests.
export default defineConfig([
  {
    ignores: [
      'node_modules',
      'dist',
      'coverage',
      'lib',
      '**/*.js',
      '**/*.d.ts',
      '.venv'
    ]
  },
  js.configs.recommended,
  tseslint.configs.recommended,
  {
    plugins: {
      jupyter: jupyterPlugin
    }
  },
  jupyterPlugin.configs.recommended,
  {
    files: ['**/*.ts', '**/*.tsx'],
    languageOptions: {
      globals: {
        ...globals.browser,
        ...globals.es2015,
        ...globals.node
      },
      parserOptions: {
        project: 'tsconfig.json',
        sourceType: 'module'
      }
    },
    rules: {
      '@typescript-eslint/naming-convention': [
        'error',
        {
          selector: 'interface',
          format: ['PascalCase'],
          custom: {
            regex: '^I[A-Z]',
            match: true
          }
        }
      ],
      '@typescript-eslint/no-unused-vars': ['warn', { args: 'none' }],
      '@typescript-eslint/no-explicit-any': 'off',
      '@typescript-eslint/no-namespace': 'off',
      '@typescript-eslint/no-use-before-define': 'off',
      // typescript-eslint 8 no longer has this rule; eslint-config-prettier (last below)
      // turns it off, and Prettier's singleQuote enforces the same thing.
      '@typescript-eslint/quotes': [
        'error',
        'single',
        { avoidEscape: true, allowTemplateLiterals: false }
      ],
      // Not in the template. src/panel.ts loads './detail' eagerly for a run's inline detail, so
      // the lazy import this rule asks for in src/index.ts would keep nothing out of start-up.
      'jupyter/prefer-lazy-imports': ['warn', { ignoreImports: ['./detail'] }],
      curly: ['error', 'all'],
      eqeqeq: 'error',
      'prefer-arrow-callback': 'error'
    }
  },
  {
    // The unit tests are outside the build's tsconfig (they are not shipped).
    files: ['src/__tests__/**/*.ts'],
    languageOptions: {
      parserOptions: { project: 'tsconfig.test.json' }
    },
    // Fixtures, not user-facing text.
    rules: { 'jupyter/no-untranslated-string': 'off' }
  },
  prettierRecommended
]);
